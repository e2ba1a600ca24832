package doccheck

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

var (
	// inlineLink matches [text](target), ![alt](target) and
	// [text](<target with spaces>), with an optional "title" after the
	// target, which is captured without it.
	inlineLink = regexp.MustCompile(`!?\[[^\]]*\]\(\s*(?:<([^>\n]+)>|([^)\s]+))(?:\s+"[^"]*")?\s*\)`)
	// refLink matches a reference definition: [label]: target.
	refLink = regexp.MustCompile(`(?m)^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)`)
	// htmlLink matches the src and href attributes of inline HTML.
	htmlLink = regexp.MustCompile(`(?:src|href)="([^"]+)"`)
	// codeSpan matches inline code, whose brackets are not links.
	codeSpan = regexp.MustCompile("`[^`\n]*`")
)

// links returns the link targets of a Markdown text, in order, outside
// fenced code blocks and code spans.
func links(md string) []string {
	var prose strings.Builder
	fenced := false
	for line := range strings.SplitSeq(md, "\n") {
		if t := strings.TrimSpace(line); strings.HasPrefix(t, "```") || strings.HasPrefix(t, "~~~") {
			fenced = !fenced
			continue
		}
		if !fenced {
			prose.WriteString(codeSpan.ReplaceAllString(line, "``"))
			prose.WriteByte('\n')
		}
	}
	text := prose.String()
	type hit struct {
		at     int
		target string
	}
	var hits []hit
	for _, re := range []*regexp.Regexp{inlineLink, refLink, htmlLink} {
		for _, m := range re.FindAllStringSubmatchIndex(text, -1) {
			// The first group that took part holds the target.
			for g := 2; g < len(m); g += 2 {
				if m[g] >= 0 {
					hits = append(hits, hit{m[g], text[m[g]:m[g+1]]})
					break
				}
			}
		}
	}
	slices.SortFunc(hits, func(a, b hit) int { return a.at - b.at })
	out := make([]string, 0, len(hits))
	for _, h := range hits {
		out = append(out, h.target)
	}
	return out
}

// localPath returns the repository path a link target names, relative to
// the folder of the file that holds it, and false for targets that are not
// files of the repository: URLs with a scheme, and anchors into the same
// file. The anchor and query of a file target are dropped.
func localPath(target string) (string, bool) {
	u, err := url.Parse(strings.ReplaceAll(target, " ", "%20"))
	if err != nil || u.Scheme != "" || u.Host != "" || u.Path == "" {
		return "", false
	}
	return u.Path, true
}

// brokenLinks returns the relative links of the Markdown file rel (a path
// from root) that name no existing file or folder under root, each as
// "rel: target (why)".
func brokenLinks(root, rel string) ([]string, error) {
	md, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		return nil, err
	}
	var broken []string
	for _, target := range links(string(md)) {
		p, ok := localPath(target)
		if !ok {
			if _, err := url.Parse(target); err != nil {
				broken = append(broken, fmt.Sprintf("%s: %s (not a URL: %v)", rel, target, err))
			}
			continue
		}
		var full string
		if strings.HasPrefix(p, "/") {
			full = filepath.Join(root, filepath.FromSlash(p))
		} else {
			full = filepath.Join(root, filepath.Dir(rel), filepath.FromSlash(p))
		}
		if r, err := filepath.Rel(root, full); err != nil || r == ".." || strings.HasPrefix(r, ".."+string(filepath.Separator)) {
			broken = append(broken, fmt.Sprintf("%s: %s (outside the repository)", rel, target))
			continue
		}
		if _, err := os.Stat(full); err != nil {
			why := "does not exist"
			if !errors.Is(err, os.ErrNotExist) {
				why = err.Error()
			}
			broken = append(broken, fmt.Sprintf("%s: %s (%s)", rel, target, why))
		}
	}
	return broken, nil
}

// repoRoot walks up from the test's folder to the one holding go.mod.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's folder")
		}
		dir = parent
	}
}

// TestDocLinks checks every relative link of README.md and docs/*.md.
func TestDocLinks(t *testing.T) {
	root := repoRoot(t)
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"README.md"}
	for _, d := range docs {
		r, err := filepath.Rel(root, d)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, filepath.ToSlash(r))
	}
	if len(docs) == 0 {
		t.Errorf("no docs/*.md under %s: the test would check nothing there", root)
	}
	for _, f := range files {
		broken, err := brokenLinks(root, f)
		if err != nil {
			t.Errorf("reading %s: %v", f, err)
			continue
		}
		if diff := cmp.Diff([]string(nil), broken); diff != "" {
			t.Errorf("%s has links to nothing (-want +got):\n%s", f, diff)
		}
	}
}

func TestLinks(t *testing.T) {
	for _, tc := range []struct {
		name string
		md   string
		want []string
	}{
		{"inline", "see [the code](proxy/loop.go) and [docs](docs/)", []string{"proxy/loop.go", "docs/"}},
		{"image and title", `![chart](a/b.png "Keep-alive") x`, []string{"a/b.png"}},
		{"anchor and URL kept", "[a](#modes) [b](https://example.com/x) [c](docs/modes.md#tproxy)", []string{"#modes", "https://example.com/x", "docs/modes.md#tproxy"}},
		{"angle brackets", "[a](<docs/a b.md>)", []string{"docs/a b.md"}},
		{"reference definition", "[ref]: docs/operations.md\n", []string{"docs/operations.md"}},
		{"html", `<img src="bench/x.png" width="600">`, []string{"bench/x.png"}},
		{"code span ignored", "`[x](nothere.md)` and [y](here.md)", []string{"here.md"}},
		{"fenced block ignored", "```\n[x](nothere.md)\n```\n[y](here.md)", []string{"here.md"}},
		{"table cell", "| [a](x.md) | [b](y.md) |", []string{"x.md", "y.md"}},
		{"no links", "plain [brackets] and (parens)", []string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if diff := cmp.Diff(tc.want, links(tc.md)); diff != "" {
				t.Errorf("links(%q) (-want +got):\n%s", tc.md, diff)
			}
		})
	}
}

func TestBrokenLinks(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"docs", "proxy"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"go.mod", "proxy/loop.go", "docs/modes.md"} {
		if err := os.WriteFile(filepath.Join(root, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name, file, md string
		want           []string
	}{
		{"all resolve", "README.md", "[a](proxy/loop.go) [b](docs/) [c](docs/modes.md#tproxy) [d](#x) [e](https://example.com/gone.md) [f](/proxy/loop.go)", nil},
		{"missing file", "README.md", "[a](docs/gone.md) [b](proxy/loop.go)", []string{"README.md: docs/gone.md (does not exist)"}},
		{"missing with anchor", "README.md", "[a](docs/gone.md#x)", []string{"README.md: docs/gone.md#x (does not exist)"}},
		{"relative to the file's folder", "docs/ops.md", "[a](modes.md) [b](../proxy/loop.go) [c](proxy/loop.go)", []string{"docs/ops.md: proxy/loop.go (does not exist)"}},
		{"outside the repository", "docs/ops.md", "[a](../../etc/passwd)", []string{"docs/ops.md: ../../etc/passwd (outside the repository)"}},
		{"missing image", "README.md", "![chart](bench/gone.png)", []string{"README.md: bench/gone.png (does not exist)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := os.WriteFile(filepath.Join(root, tc.file), []byte(tc.md), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := brokenLinks(root, tc.file)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("brokenLinks(%q) (-want +got):\n%s", tc.md, diff)
			}
		})
	}
}
