package doccheck

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// Code comments say why, not how much. A figure measured on one
// machine at one commit goes stale the day the code changes, and nothing
// tells the reader; the measurements belong in the bench reports and
// docs/performance.md, which say when and where they were taken.
//
// The line drawn here: a setting is a single value that the code itself
// defines and that changes in the same diff as it ("zero means 1s", "every
// 20ms", "pipes hold 1 MiB", "RFC 5737", "port 8080"), so a comment may
// state it. A measurement is what something achieved or cost on some
// machine: a rate, a share, a range of results, a sub-millisecond cost,
// or a time or size that something took, cost or was about. uproxy has
// no setting finer than a millisecond, so a microsecond or nanosecond
// figure in a comment is always a cost someone measured.

// commentFigureNumber is a number as prose writes it ("3", "0.65",
// "10,000"), not glued to a preceding word, digit or dot, so "v1.37",
// "x86" and the parts of "0.0.0.0" and "10.96.0.0/16" are not numbers.
// Each rule's figure is its first group; the number's own group opens
// here and the rule closes it after the figure's unit.
const commentFigureNumber = `(?:^|[^\w.])(\d[\d,]*(?:\.\d+)?`

// commentFigureBareNumber is a number inside a figure, after a dash or a
// word that already separates it.
const commentFigureBareNumber = `\d[\d,]*(?:\.\d+)?`

const (
	commentFigureTime = `(?:ns|µs|μs|us|ms|s|sec|secs|seconds?|min|minutes?|h|hours?)`
	commentFigureSize = `(?:B|bytes?|KB|MB|GB|KiB|MiB|GiB|TiB|pages?)`
	commentFigureRate = `(?:[KMGT]?bit|[KMGT]?b|[KMGT]i?B|B|req|reqs|requests|q|queries|conn|conns|connections|ops|packets|datagrams|calls|syscalls|sessions|flows)/s`
)

// commentFigureReports is the folder of the bench reports, spelled so that
// a grep for it finds no Go file outside bench/, this one included.
const commentFigureReports = "bench/" + "results"

// commentFigureRules are the shapes of a measured figure, each named for
// the failure message, in the order they are tried.
var commentFigureRules = []struct {
	name string
	re   *regexp.Regexp
}{
	{"link into the bench reports", regexp.MustCompile(`(` + regexp.QuoteMeta(commentFigureReports) + `)`)},
	{"rate", regexp.MustCompile(commentFigureNumber + `\s*` + commentFigureRate + `)`)},
	{"rate", regexp.MustCompile(commentFigureNumber + `\s*(?:pps|qps|rps|cps))\b`)},
	{"rate", regexp.MustCompile(commentFigureNumber + `\s+(?:[a-zA-Z-]+\s+)?(?:a|per|each)\s+second)\b`)},
	{"range of results", regexp.MustCompile(commentFigureNumber + `\s*[-–—]\s*` + commentFigureBareNumber +
		`\s*(?:` + commentFigureTime + `|` + commentFigureSize + `))\b`)},
	{"range of results", regexp.MustCompile(commentFigureNumber + `\s*[-–—]\s*` + commentFigureBareNumber + `\s*(?:%|×|x\b))`)},
	{"percentage", regexp.MustCompile(commentFigureNumber + `\s*(?:%|percent\b))`)},
	// A range of settings written out in prose restates two constants,
	// which drift apart from it; name the constants or the function.
	{"restated range", regexp.MustCompile(`\b(from\s+` + commentFigureBareNumber + `\s*(?:` + commentFigureTime + `|` + commentFigureSize + `)\s+to\s+` +
		commentFigureBareNumber + `\s*(?:` + commentFigureTime + `|` + commentFigureSize + `))\b`)},
	{"sub-millisecond time", regexp.MustCompile(commentFigureNumber + `\s*(?:ns|µs|μs|us))\b`)},
	{"ratio", regexp.MustCompile(`(?:^|[^\w.])(\d+\.\d+\s*(?:×|x\b))`)},
	{"ratio", regexp.MustCompile(commentFigureNumber + `\s*(?:×|x|times)\s+(?:faster|slower|more|less|fewer|higher|lower|better|worse|as\s+\w+\s+as))\b`)},
	{"measured time or size", regexp.MustCompile(`(?i)\b((?:took|takes|take|taking|cost|costs|costing|spent|spends|spend|saved|saves|save|about|around|roughly|nearly|almost|approximately|instead\s+of|against)\s+(?:only\s+|just\s+|some\s+)?` +
		commentFigureBareNumber + `\s*(?:` + commentFigureTime + `|` + commentFigureSize + `))\b`)},
}

// commentFigure returns the name of the first rule that line, the text of
// one comment line, breaks, and the figure that broke it; ok is false if
// it breaks none.
func commentFigure(line string) (rule, figure string, ok bool) {
	for _, r := range commentFigureRules {
		if m := r.re.FindStringSubmatch(line); m != nil {
			return r.name, m[1], true
		}
	}
	return "", "", false
}

func TestCommentFigureMatcher(t *testing.T) {
	type verdict struct {
		Rule, Match string
	}
	tests := []struct {
		line string
		want *verdict // nil: a legitimate comment
	}{
		// Settings, references and addresses stay.
		{"zero means 1s, kube-proxy's default", nil},
		{"Zero (or negative) means 10800s, kube-proxy's default", nil},
		{"100ms, 200ms, 400ms, 800ms by default; zero means 100ms.", nil},
		{"the kernel's default (16 pages, 64 KiB).", nil},
		{"Its pipes hold 1 MiB (as the runtime's do)", nil},
		{"transfer streams payload to c in 16 KiB pieces", nil},
		{"VIPs from RFC 5737 and port 8080 on 0.0.0.0", nil},
		{"pods 10.244.0.0/16, external 192.0.2.0/24, 2001:db8::/32", nil},
		{"k8s.io/kubernetes v1.37.2, files proxy_health.go", nil},
		{"kube-proxy uses 2 × the sync period", nil},
		{"keep-alive with Go's default timing (15s idle, 15s between probes, 9 probes)", nil},
		{"with 30 s flows and 20,000 descriptors", nil},
		{"a sweep of 10,000 services", nil},
		{"x86 and arm64 both", nil},
		{"see issue #30 and commit 4f3a2b1", nil},
		{"every 2 seconds at most", nil},
		{"nf_conntrack_tcp_timeout_time_wait, 120 s by default", nil},

		// Measurements go.
		{"see " + commentFigureReports + "/2026-11-30-iocopy.md", &verdict{"link into the bench reports", commentFigureReports}},
		{"carried 1,570 connections/s", &verdict{"rate", "1,570 connections/s"}},
		{"up to 9.4 Gbit/s through the splice", &verdict{"rate", "9.4 Gbit/s"}},
		{"at 120000 req/s", &verdict{"rate", "120000 req/s"}},
		{"670 queries a second", &verdict{"rate", "670 queries a second"}},
		{"a workload that carried 4% more connections", &verdict{"percentage", "4%"}},
		{"by more than about 1 percent", &verdict{"percentage", "1 percent"}},
		{"uproxy's share 290µs of CPU each", &verdict{"sub-millisecond time", "290µs"}},
		{"at about 1 µs each", &verdict{"sub-millisecond time", "1 µs"}},
		{"took 0.65-0.66 s instead of 0.70-0.80 s", &verdict{"range of results", "0.65-0.66 s"}},
		{"kept 8–10 KiB of stacks per idle connection", &verdict{"range of results", "8–10 KiB"}},
		{"10-16 ms later", &verdict{"range of results", "10-16 ms"}},
		{"carried 3-11% more keep-alive requests", &verdict{"range of results", "3-11%"}},
		{"it backs off from 5ms to 1s, as net/http's Server does", &verdict{"restated range", "from 5ms to 1s"}},
		{"a bulk transfer was 6x faster", &verdict{"ratio", "6x faster"}},
		{"two loops gave 1.06x the keep-alive rate", &verdict{"ratio", "1.06x"}},
		{"at 0.75× the p99 of kube-proxy", &verdict{"ratio", "0.75×"}},
		{"mark 0x200000, table 117", nil},
		{"a bulk transfer was 6 times slower", &verdict{"ratio", "6 times slower"}},
		{"10,000 per-service listeners took 2.1 s to bind", &verdict{"measured time or size", "took 2.1 s"}},
		{"an endpoint change cost 4.5 ms instead of tens", &verdict{"measured time or size", "cost 4.5 ms"}},
		{"process start (about 7 ms), per jump", &verdict{"measured time or size", "about 7 ms"}},
		{"and the set takes 8 KiB.", &verdict{"measured time or size", "takes 8 KiB"}},
	}
	for _, tt := range tests {
		var got *verdict
		if rule, match, ok := commentFigure(tt.line); ok {
			got = &verdict{rule, match}
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("commentFigure(%q) (-want +got):\n%s", tt.line, diff)
		}
	}
}

// TestCommentsHaveNoFigures fails for every comment line of the
// repository's Go files, outside bench/, that links into the bench reports
// or states a measured figure. Put the figure in docs/performance.md or a
// bench report, and leave the reason in the comment.
func TestCommentsHaveNoFigures(t *testing.T) {
	root, err := commentsRepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	files, err := commentsGoFiles(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no Go files found under %s", root)
	}
	for _, path := range files {
		for _, f := range commentsFindFigures(t, root, path) {
			t.Errorf("%s: comment states a %s (%q): comments say why, not how much", f.pos, f.rule, f.match)
		}
	}
}

type commentFinding struct {
	pos, rule, match string
}

// commentsFindFigures parses the Go file at path and returns every comment
// line that breaks a rule, its position relative to root. A generated
// file's comments are its generator's, and are skipped.
func commentsFindFigures(t *testing.T, root, path string) []commentFinding {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil {
		t.Errorf("parse %s: %v", path, err)
		return nil
	}
	if ast.IsGenerated(f) {
		return nil
	}
	rel, err := filepath.Rel(root, path)
	if err != nil {
		rel = path
	}
	var out []commentFinding
	for _, group := range f.Comments {
		for _, c := range group.List {
			line := fset.Position(c.Slash).Line
			for i, text := range strings.Split(c.Text, "\n") {
				if rule, match, ok := commentFigure(text); ok {
					out = append(out, commentFinding{fmt.Sprintf("%s:%d", filepath.ToSlash(rel), line+i), rule, match})
				}
			}
		}
	}
	return out
}

// commentsRepoRoot walks up from the working directory to the directory
// holding go.mod.
func commentsRepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// commentsGoFiles lists the .go files under root that the check covers:
// all but bench/ (whose reports and harness may quote figures), testdata,
// vendor, and the directories the go tool ignores.
func commentsGoFiles(root string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != root && (name == "testdata" || name == "vendor" ||
				strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
				return filepath.SkipDir
			}
			if rel, _ := filepath.Rel(root, path); filepath.ToSlash(rel) == "bench" {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, ".go") {
			files = append(files, path)
		}
		return nil
	})
	return files, err
}

func TestCommentsGoFilesSkips(t *testing.T) {
	root := t.TempDir()
	for _, f := range []string{
		"go.mod", "a.go", "a.txt", "bench/b.go", "x/testdata/c.go", "vendor/d.go",
		".hidden/e.go", "_old/h.go", "x/f.go", "x/bench/g.go",
	} {
		path := filepath.Join(root, filepath.FromSlash(f))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte("package x\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	files, err := commentsGoFiles(root)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, f := range files {
		rel, _ := filepath.Rel(root, f)
		got = append(got, filepath.ToSlash(rel))
	}
	// Only the top-level bench/ holds the harness; a package's own bench
	// folder is checked like any other.
	want := []string{"a.go", "x/bench/g.go", "x/f.go"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("commentsGoFiles (-want +got):\n%s", diff)
	}
}

func TestCommentsFindFigures(t *testing.T) {
	root := t.TempDir()
	// The figures are put in with Sprintf, so that a grep of this file
	// for a comment with a figure finds none.
	src := fmt.Sprintf(`package x

import "time"

// timeout is how long a dial may take; zero means 1s.
var timeout = 30 * time.Second // was %s in the lab

/*
A block comment
that carried 4%% more requests.
*/
var s = "this string says 10 µs, but is no comment"
`, "0.5-0.7 s")
	path := filepath.Join(root, "x.go")
	if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	gen := filepath.Join(root, "gen.go")
	genFigure := "5 ms"
	genSrc := fmt.Sprintf("// Code generated by hand. DO NOT EDIT.\n\n// It took %s.\npackage x\n", genFigure)
	if err := os.WriteFile(gen, []byte(genSrc), 0o644); err != nil {
		t.Fatal(err)
	}
	got := append(commentsFindFigures(t, root, path), commentsFindFigures(t, root, gen)...)
	want := []commentFinding{
		{"x.go:6", "range of results", "0.5-0.7 s"},
		{"x.go:10", "percentage", "4%"},
	}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(commentFinding{})); diff != "" {
		t.Errorf("commentsFindFigures (-want +got):\n%s", diff)
	}
}
