package main

import (
	"errors"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// docFlag is a flag as the docs cite it: in backquotes, first in the
// span ("`--mode tproxy`"), or a family of them ("`--iptables-*`").
var docFlag = regexp.MustCompile("`--([a-z][a-z0-9-]*)(\\*)?")

// foreignFlags are flags the docs cite that belong to other programs,
// each with its owner.
var foreignFlags = map[string]string{
	"physdev-is-in": "iptables' physdev match",
}

// benchFlag is a flag definition in bench's sources: bench is a module of
// its own, which this test cannot import.
var benchFlag = regexp.MustCompile(`\.(?:String|Bool|Int|Int64|Uint|Float64|Duration|StringSlice|StringArray|IntSlice|Count)(?:Var)?P?\((?:&[\w.]+,\s*)?"([a-z][a-z0-9-]*)"`)

// TestDocsCiteExistingFlags checks that every flag the Markdown files cite
// is one of uproxy's (hidden and deprecated ones included) or bench's, so a
// renamed or removed flag cannot linger in the docs. A family ("--conntrack-*") must name at
// least one flag.
func TestDocsCiteExistingFlags(t *testing.T) {
	flags := map[string]bool{"help": true} // cobra adds it to every command when it runs
	visitFlags(newRootCommand(), func(_ *cobra.Command, f *pflag.Flag) { flags[f.Name] = true })
	benchSources, err := filepath.Glob("../../bench/*.go")
	internal, err2 := filepath.Glob("../../bench/internal/*/*.go")
	benchSources = append(benchSources, internal...)
	if err = errors.Join(err, err2); err != nil || len(benchSources) == 0 {
		t.Fatalf("bench's sources: %v", err)
	}
	for _, f := range benchSources {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range benchFlag.FindAllSubmatch(src, -1) {
			flags[string(m[1])] = true
		}
	}

	cited := 0
	for _, doc := range citingDocs(t) {
		text, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range docFlag.FindAllStringSubmatch(string(text), -1) {
			cited++
			name, family := m[1], m[2] != ""
			switch {
			case foreignFlags[name] != "":
			case family:
				if !slices.ContainsFunc(slices.Collect(maps.Keys(flags)), func(f string) bool { return strings.HasPrefix(f, name) }) {
					t.Errorf("%s cites --%s*, but uproxy has no flag that starts so", doc, name)
				}
			case !flags[name]:
				t.Errorf("%s cites --%s, which is neither uproxy's flag nor bench's", doc, name)
			}
		}
	}
	if cited < 50 {
		t.Errorf("the docs cite %d flags; the pattern no longer finds them", cited)
	}
}

// citingDocs returns the project's Markdown files but the bench reports,
// which quote the flags of the day they were run.
func citingDocs(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("git", "-C", "../..", "ls-files", "*.md").Output()
	if err != nil {
		t.Fatalf("listing the docs (git ls-files): %v", err)
	}
	var docs []string
	for _, f := range strings.Fields(string(out)) {
		if !strings.HasPrefix(f, "bench/results/") {
			docs = append(docs, filepath.Join("../..", f))
		}
	}
	return docs
}

// visitFlags calls visit with every flag of root and its subcommands,
// hidden and deprecated ones included, and returns the commands.
func visitFlags(root *cobra.Command, visit func(*cobra.Command, *pflag.Flag)) []*cobra.Command {
	commands := []*cobra.Command{root}
	for i := 0; i < len(commands); i++ {
		c := commands[i]
		for _, fs := range []*pflag.FlagSet{c.Flags(), c.PersistentFlags()} {
			fs.VisitAll(func(f *pflag.Flag) { visit(c, f) })
		}
		commands = append(commands, c.Commands()...)
	}
	return commands
}

// sentenceBreak is the end of a sentence followed by another one.
var sentenceBreak = regexp.MustCompile(`[.!?] +[A-Z]`)

// helpFlag is a flag as a command's help text names it.
var helpFlag = regexp.MustCompile(`--([a-z][a-z0-9-]*)`)

// TestFlagHelpIsOneSentence checks that each flag's help is one sentence
// (the details are in docs/operations.md), and that the commands' own
// help names only flags that exist.
func TestFlagHelpIsOneSentence(t *testing.T) {
	const maxUsage = 200
	flags := map[string]bool{"help": true}
	commands := visitFlags(newRootCommand(), func(c *cobra.Command, f *pflag.Flag) {
		flags[f.Name] = true
		if f.Hidden || f.Deprecated != "" {
			return // kube-proxy's, shown by no help
		}
		if len(f.Usage) > maxUsage || sentenceBreak.MatchString(f.Usage) {
			t.Errorf("%s --%s: help of %d characters, or more than one sentence: %q", c.CommandPath(), f.Name, len(f.Usage), f.Usage)
		}
	})
	for _, c := range commands {
		for _, m := range helpFlag.FindAllStringSubmatch(c.Short+"\n"+c.Long+"\n"+c.Example, -1) {
			if !flags[m[1]] {
				t.Errorf("%s's help names --%s, which no command has", c.CommandPath(), m[1])
			}
		}
	}
}

// TestRunHelpGroupsIgnoredFlags checks that `uproxy run --help` lists the
// kube-proxy flags it accepts and ignores apart, after the flags that do
// something, and that the address flags name their value.
func TestRunHelpGroupsIgnoredFlags(t *testing.T) {
	root := newRootCommand()
	var out strings.Builder
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs([]string{"run", "--help"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	help := out.String()
	own, ignored, found := strings.Cut(help, "kube-proxy's flags, accepted and ignored")
	if !found {
		t.Fatalf("no section of ignored kube-proxy flags in:\n%s", help)
	}
	ignored, _, _ = strings.Cut(ignored, "Global Flags:")
	listed := func(in, name string) bool {
		return strings.Contains(in, "--"+name+" ") || strings.Contains(in, "--"+name+"[")
	}
	for _, f := range ignoredKubeProxyFlags {
		if !listed(ignored, f.name) || listed(own, f.name) {
			t.Errorf("--%s is not listed among the ignored flags alone", f.name)
		}
	}
	for _, f := range []string{"--balancer ", "--mode ", "--cleanup[", "--masquerade-all[", "--feature-gates "} {
		if !strings.Contains(own, f) || strings.Contains(ignored, f) {
			t.Errorf("%s is not listed among uproxy's flags alone", strings.TrimRight(f, " ["))
		}
	}
	for _, f := range []string{"--debug-bind-address host:port", "--healthz-bind-address host:port", "--metrics-bind-address host:port"} {
		if !strings.Contains(own, f) {
			t.Errorf("help lacks %q", f)
		}
	}
}
