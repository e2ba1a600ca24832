package doccheck

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// issueNumber is an issue or pull-request number (a hash sign and digits),
// which tells a reader of the code nothing; the history is in git. PKCS#1 and
// the like are names, glued to the word before them.
var issueNumber = regexp.MustCompile(`(?:^|[^\w#])#\d+\b`)

// TestGoCommentsNameNoIssues checks that no Go comment, bench's included,
// cites an issue number.
func TestGoCommentsNameNoIssues(t *testing.T) {
	root := repoRoot(t)
	files := goFilesWithBench(t, root)
	for _, path := range files {
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			t.Errorf("parse %s: %v", path, err)
			continue
		}
		for _, group := range f.Comments {
			for _, c := range group.List {
				if m := issueNumber.FindString(c.Text); m != "" {
					rel, _ := filepath.Rel(root, fset.Position(c.Slash).Filename)
					t.Errorf("%s:%d: comment cites an issue (%q): say why in words; the history is in git", rel, fset.Position(c.Slash).Line, strings.TrimSpace(m))
				}
			}
		}
	}
}

func TestIssueNumberMatcher(t *testing.T) {
	for _, tt := range []struct {
		text string
		want bool
	}{
		{"// fixed in (#30).", true},
		{"// #31's targets", true},
		{"// see #7", true},
		{"// PKCS#1 keys", false},
		{"// [Where](#where-the-cpu-goes)", false},
		{"// port 8080", false},
	} {
		if got := issueNumber.MatchString(tt.text); got != tt.want {
			t.Errorf("%q: matched %v, want %v", tt.text, got, tt.want)
		}
	}
}

// goFilesWithBench lists every .go file the repository tracks but
// testdata.
func goFilesWithBench(t *testing.T, root string) []string {
	t.Helper()
	var files []string
	for _, f := range gitFiles(t, root, "*.go") {
		if !strings.Contains("/"+f, "/testdata/") {
			files = append(files, filepath.Join(root, f))
		}
	}
	if len(files) == 0 {
		t.Fatalf("no Go files under %s", root)
	}
	return files
}

// gitFiles lists the tracked files under root that match pattern.
func gitFiles(t *testing.T, root, pattern string) []string {
	t.Helper()
	out, err := exec.Command("git", "-C", root, "ls-files", pattern).Output()
	if err != nil {
		t.Fatalf("listing the tracked files (git ls-files %s): %v", pattern, err)
	}
	files := strings.Fields(string(out))
	if len(files) == 0 {
		t.Fatalf("git ls-files %s lists nothing: the check would pass anything", pattern)
	}
	return files
}

// citingDocs lists the Markdown files whose citations must hold: all but
// bench's reports, which quote the names of the day they were run.
func citingDocs(t *testing.T, root string) map[string]string {
	t.Helper()
	docs := map[string]string{}
	for _, f := range gitFiles(t, root, "*.md") {
		if strings.HasPrefix(f, "bench/results/") {
			continue
		}
		text, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		docs[f] = string(text)
	}
	if len(docs) == 0 {
		t.Fatalf("no Markdown files under %s", root)
	}
	return docs
}

// citedTest is a test, benchmark or fuzz target as the docs name it;
// "TestUpgrade*" names every test that starts so.
var citedTest = regexp.MustCompile(`\b((?:Test|Benchmark|Fuzz)[A-Z][A-Za-z0-9_]*)(\*)?`)

var testFunc = regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)[A-Z][A-Za-z0-9_]*)\(`)

// TestDocsCiteExistingTests checks that every test the docs name exists,
// so that a doc's "checked by" cannot point at a renamed or deleted test.
func TestDocsCiteExistingTests(t *testing.T) {
	root := repoRoot(t)
	var defined []string
	for _, f := range gitFiles(t, root, "*_test.go") {
		src, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range testFunc.FindAllSubmatch(src, -1) {
			defined = append(defined, string(m[1]))
		}
	}
	for doc, text := range citingDocs(t, root) {
		for _, m := range citedTest.FindAllStringSubmatch(text, -1) {
			if missing := missingName(defined, m[1], m[2] != ""); missing != "" {
				t.Errorf("%s cites %s, but no test %s", doc, m[0], missing)
			}
		}
	}
}

// missingName says how name (a prefix, when family is set) is not among
// defined, or "" when it is.
func missingName(defined []string, name string, family bool) string {
	for _, d := range defined {
		if d == name || family && strings.HasPrefix(d, name) {
			return ""
		}
	}
	if family {
		return "starts with " + name
	}
	return "is named so"
}

// citedMetric is a metric as the docs name it; a histogram's series
// suffixes name the histogram.
var citedMetric = regexp.MustCompile(`\b((?:uproxy|kubeproxy)_[a-z0-9_]*[a-z0-9])\b`)

// kubeProxyOnlyMetrics are kube-proxy's metrics that docs/operations.md
// lists as ones uproxy does not export, and why.
var kubeProxyOnlyMetrics = map[string]bool{
	"kubeproxy_sync_proxy_rules_iptables_total":                     true,
	"kubeproxy_sync_proxy_rules_iptables_last":                      true,
	"kubeproxy_iptables_ct_state_invalid_dropped_packets_total":     true,
	"kubeproxy_iptables_localhost_nodeports_accepted_packets_total": true,
}

// TestDocsCiteExistingMetrics checks that every uproxy_ and kubeproxy_
// metric the docs name is one the code defines: as a full name in a string
// ("uproxy_bytes_total"), or, for kube-proxy's, as the Name after the
// "kubeproxy" subsystem.
func TestDocsCiteExistingMetrics(t *testing.T) {
	root := repoRoot(t)
	defined := map[string]bool{}
	for _, path := range goFilesWithBench(t, root) {
		if strings.HasSuffix(path, "_test.go") || strings.Contains(path, "/bench/") {
			continue
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("parse %s: %v", path, err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				s := strings.Trim(lit.Value, "\"`")
				defined[s] = true
				defined["kubeproxy_"+s] = true
			}
			return true
		})
	}
	for doc, text := range citingDocs(t, root) {
		for _, m := range citedMetric.FindAllStringSubmatch(text, -1) {
			name := m[1]
			base := name
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				base = strings.TrimSuffix(base, suffix)
			}
			switch {
			case kubeProxyOnlyMetrics[name] && defined[name]:
				t.Errorf("%s: uproxy defines %s now: take it off kubeProxyOnlyMetrics and the docs' list of those it lacks", doc, name)
			case kubeProxyOnlyMetrics[name]:
			case !defined[name] && !defined[base]:
				t.Errorf("%s cites the metric %s, which the code does not define", doc, name)
			}
		}
	}
	if len(defined) == 0 {
		t.Fatal("no string in the code: the check would pass anything")
	}
}

// maxPackageDocLines is how long a package's documentation may be: a map
// of what the package owns, its main types and where to look next. A
// longer explanation is a page in docs/.
const maxPackageDocLines = 40

// TestPackageDocsAreMaps checks every package's documentation, bench's
// included, against maxPackageDocLines.
func TestPackageDocsAreMaps(t *testing.T) {
	root := repoRoot(t)
	for _, path := range goFilesWithBench(t, root) {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.PackageClauseOnly)
		if err != nil {
			t.Errorf("parse %s: %v", path, err)
			continue
		}
		if f.Doc == nil {
			continue
		}
		if n := strings.Count(f.Doc.Text(), "\n"); n > maxPackageDocLines {
			rel, _ := filepath.Rel(root, path)
			t.Errorf("%s: the package documentation is %d lines; make it a map of at most %d, and move the explanation to docs/", rel, n, maxPackageDocLines)
		}
	}
}

// maxTestSleeps is how many time.Sleep calls the tests may make: a test
// waits on a condition (internal/testwait), and sleeps only to pace a
// sender or to time a fault, saying so.
const maxTestSleeps = 20

// TestTestsSleepRarely checks that the tests, bench's included, call
// time.Sleep at most maxTestSleeps times, each with a comment on its line
// or the line before that says why.
func TestTestsSleepRarely(t *testing.T) {
	root := repoRoot(t)
	var sleeps []string
	for _, f := range gitFiles(t, root, "*_test.go") {
		if strings.HasPrefix(f, "internal/doccheck/") {
			continue // names the call it counts
		}
		src, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(src), "\n")
		for i, line := range lines {
			if !strings.Contains(line, "time.Sleep(") || strings.HasPrefix(strings.TrimSpace(line), "//") {
				continue
			}
			sleeps = append(sleeps, fmt.Sprintf("%s:%d", f, i+1))
			if !strings.Contains(line, "//") && (i == 0 || !strings.HasPrefix(strings.TrimSpace(lines[i-1]), "//")) {
				t.Errorf("%s:%d: a sleep without a comment saying why a sleep is the right tool here (or wait on a condition with internal/testwait)", f, i+1)
			}
		}
	}
	if len(sleeps) > maxTestSleeps {
		t.Errorf("the tests sleep %d times, more than %d: wait on conditions with internal/testwait instead:\n%s", len(sleeps), maxTestSleeps, strings.Join(sleeps, "\n"))
	}
}

// maxMethods is how many methods a type may declare, exported or not:
// past it, the type does more than one thing.
const maxMethods = 30

// tooManyMethods are the exported types over maxMethods today, with their
// counts, until they are split: a type may not grow past its count, and
// leaves the list once it is within maxMethods.
var tooManyMethods = map[string]int{}

// TestTypesHaveFewMethods counts the methods that every type of the
// project's packages declares (tests and bench's excluded).
func TestTypesHaveFewMethods(t *testing.T) {
	root := repoRoot(t)
	counts := map[string]int{}
	for _, path := range goFilesWithBench(t, root) {
		rel, _ := filepath.Rel(root, path)
		if strings.HasSuffix(path, "_test.go") || strings.HasPrefix(rel, "bench/") {
			continue
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("parse %s: %v", rel, err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv == nil || len(fn.Recv.List) != 1 {
				continue
			}
			typ := fn.Recv.List[0].Type
			if star, ok := typ.(*ast.StarExpr); ok {
				typ = star.X
			}
			if idx, ok := typ.(*ast.IndexExpr); ok {
				typ = idx.X
			}
			if id, ok := typ.(*ast.Ident); ok {
				counts[f.Name.Name+"."+id.Name]++
			}
		}
	}
	if len(counts) == 0 {
		t.Fatal("no methods found: the check would pass anything")
	}
	for name, n := range counts {
		limit, listed := tooManyMethods[name]
		switch {
		case listed && n > limit:
			t.Errorf("%s has %d methods, more than its %d: split it rather than grow it", name, n, limit)
		case listed && n <= maxMethods:
			t.Errorf("%s has %d methods now: take it off tooManyMethods", name, n)
		case listed && n < limit:
			t.Errorf("%s has %d methods, fewer than its %d: lower its count in tooManyMethods", name, n, limit)
		case !listed && n > maxMethods:
			t.Errorf("%s has %d methods, more than %d: split it by job", name, n, maxMethods)
		}
	}
	for name := range tooManyMethods {
		if _, ok := counts[name]; !ok {
			t.Errorf("tooManyMethods names %s, which has no method now", name)
		}
	}
}

// maxReadmeBytes bounds the README, the front door: what uproxy is, how
// to run it, its modes, one performance table and where things live;
// everything else belongs in docs/.
const maxReadmeBytes = 15000

// TestReadmeIsShort checks the README against maxReadmeBytes.
func TestReadmeIsShort(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > maxReadmeBytes {
		t.Errorf("README.md is %d bytes, more than %d: move the detail to docs/", len(b), maxReadmeBytes)
	}
}
