// Command e2ereport turns the JUnit reports of Kubernetes e2e runs, one per
// service proxy, into the table of docs/conformance.md: a row per spec, a
// column per proxy, and the reason for each spec that did not run.
//
//	e2ereport -focus RE [-skip RE] [-count COL,...] [-reasons FILE] \
//	    -out docs/conformance.md -header FILE COLUMN=junit.xml ...
//
// Its last line on standard output is "conformance: P passed, F failed, S
// skipped", counted over the columns that -count names (by default all).
// It exits 1 when a spec fails in a counted column but passes in another:
// the failure is the counted proxy's, not the cluster's.
package main

import (
	"bufio"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
)

// result is one spec's outcome in one run.
type result struct {
	Status  string // passed, failed, skipped, or "" when the run lacks it
	Message string // the skip or failure message, first line
}

type testcase struct {
	Name    string `xml:"name,attr"`
	Status  string `xml:"status,attr"`
	Skipped *struct {
		Message string `xml:"message,attr"`
	} `xml:"skipped"`
	Failure *struct {
		Message string `xml:"message,attr"`
	} `xml:"failure"`
	Error *struct {
		Message string `xml:"message,attr"`
	} `xml:"error"`
}

type junit struct {
	Suites []struct {
		Cases []testcase `xml:"testcase"`
	} `xml:"testsuite"`
}

// readJUnit returns the outcome of each spec ("[It] " trimmed from its
// name) whose name matches focus and not skip.
func readJUnit(r io.Reader, focus, skip *regexp.Regexp) (map[string]result, error) {
	var j junit
	if err := xml.NewDecoder(r).Decode(&j); err != nil {
		return nil, fmt.Errorf("decoding JUnit XML: %w", err)
	}
	out := map[string]result{}
	for _, s := range j.Suites {
		for _, c := range s.Cases {
			name, ok := strings.CutPrefix(c.Name, "[It] ")
			if !ok || !focus.MatchString(name) || (skip != nil && skip.MatchString(name)) {
				continue
			}
			res := result{Status: c.Status}
			switch {
			case c.Failure != nil:
				res.Status, res.Message = "failed", c.Failure.Message
			case c.Error != nil:
				res.Status, res.Message = "failed", c.Error.Message
			case c.Skipped != nil:
				res.Status, res.Message = "skipped", c.Skipped.Message
			}
			if res.Status == "pending" || res.Status == "" {
				res.Status = "skipped"
			}
			res.Message = firstLine(res.Message)
			out[name] = res
		}
	}
	return out, nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	s = strings.TrimPrefix(s, "skipped - ")
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return strings.TrimSpace(s)
}

// reason is a known cause for specs not to run or not to pass on the dev
// cluster: pattern matches the suite's skip message, or the name of a spec
// that passed nowhere.
type reason struct {
	pattern *regexp.Regexp
	text    string
}

// readReasons reads lines of "REGEXP<TAB>REASON"; # starts a comment.
func readReasons(r io.Reader) ([]reason, error) {
	var out []reason
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		re, text, ok := strings.Cut(line, "\t")
		if !ok {
			return nil, fmt.Errorf("line %d: want REGEXP<TAB>REASON", n)
		}
		p, err := regexp.Compile(strings.TrimSpace(re))
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, reason{p, strings.TrimSpace(text)})
	}
	return out, sc.Err()
}

type column struct {
	name    string
	results map[string]result
}

// table renders the rows, one per spec seen in any column, sorted by name.
func table(cols []column, reasons []reason) string {
	var names []string
	for _, c := range cols {
		for n := range c.results {
			if !slices.Contains(names, n) {
				names = append(names, n)
			}
		}
	}
	slices.Sort(names)
	var b strings.Builder
	b.WriteString("| spec |")
	for _, c := range cols {
		fmt.Fprintf(&b, " %s |", c.name)
	}
	b.WriteString(" why not run, or not passed |\n|---|")
	for range cols {
		b.WriteString("---|")
	}
	b.WriteString("---|\n")
	for _, n := range names {
		fmt.Fprintf(&b, "| %s |", strings.ReplaceAll(n, "|", `\|`))
		var why []string
		passedAll, passedAny := true, false
		for _, c := range cols {
			r := c.results[n]
			mark := map[string]string{"passed": "pass", "failed": "**fail**", "skipped": "skip", "": "not run"}[r.Status]
			fmt.Fprintf(&b, " %s |", mark)
			passedAll = passedAll && r.Status == "passed"
			passedAny = passedAny || r.Status == "passed"
			if r.Status == "skipped" && r.Message != "" && !slices.Contains(why, r.Message) {
				why = append(why, r.Message)
			}
		}
		// A known reason replaces the suite's messages: matched on a skip
		// message, or, when the spec passed in no column, on its name. A
		// spec that passed everywhere needs none, and one that passed
		// somewhere is not excused by its name.
		for _, r := range reasons {
			if passedAll {
				break
			}
			if slices.ContainsFunc(why, r.pattern.MatchString) || !passedAny && r.pattern.MatchString(n) {
				why = []string{r.text}
				break
			}
		}
		fmt.Fprintf(&b, " %s |\n", strings.ReplaceAll(strings.Join(why, "; "), "|", `\|`))
	}
	return b.String()
}

// tally counts the outcomes in the counted columns, and returns the specs
// that fail there but pass in some other column.
func tally(cols []column, counted []string) (passed, failed, skipped int, regressions []string) {
	for _, c := range cols {
		if len(counted) > 0 && !slices.Contains(counted, c.name) {
			continue
		}
		for n, r := range c.results {
			switch r.Status {
			case "passed":
				passed++
			case "failed":
				failed++
				for _, o := range cols {
					if o.results[n].Status == "passed" {
						regressions = append(regressions, fmt.Sprintf("%s: %s (passes with %s)", c.name, n, o.name))
						break
					}
				}
			default:
				skipped++
			}
		}
	}
	slices.Sort(regressions)
	return passed, failed, skipped, regressions
}

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "e2ereport:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("e2ereport", flag.ContinueOnError)
	focus := fs.String("focus", "", "the specs of the table: a regular expression on their names")
	skip := fs.String("skip", "", "specs left out of the table")
	count := fs.String("count", "", "comma-separated columns whose outcomes the summary counts (default all)")
	reasonsFile := fs.String("reasons", "", "a file of REGEXP<TAB>REASON lines: why matching specs do not run here")
	header := fs.String("header", "", "a file whose text goes before the table")
	out := fs.String("out", "", "the markdown file to write")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *focus == "" || *out == "" || fs.NArg() == 0 {
		return errors.New("usage: e2ereport -focus RE -out FILE [flags] COLUMN=junit.xml")
	}
	focusRE, err := regexp.Compile(*focus)
	if err != nil {
		return fmt.Errorf("-focus: %w", err)
	}
	var skipRE *regexp.Regexp
	if *skip != "" {
		if skipRE, err = regexp.Compile(*skip); err != nil {
			return fmt.Errorf("-skip: %w", err)
		}
	}
	var reasons []reason
	if *reasonsFile != "" {
		f, err := os.Open(*reasonsFile)
		if err != nil {
			return err
		}
		reasons, err = readReasons(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", *reasonsFile, err)
		}
	}
	var cols []column
	for _, a := range fs.Args() {
		name, file, ok := strings.Cut(a, "=")
		if !ok {
			return fmt.Errorf("%q: want COLUMN=junit.xml", a)
		}
		c := column{name: name, results: map[string]result{}}
		if f, err := os.Open(file); err == nil {
			c.results, err = readJUnit(f, focusRE, skipRE)
			f.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", file, err)
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		cols = append(cols, c)
	}
	var doc strings.Builder
	if *header != "" {
		h, err := os.ReadFile(*header)
		if err != nil {
			return err
		}
		doc.Write(h)
	}
	doc.WriteString(table(cols, reasons))
	if err := os.WriteFile(*out, []byte(doc.String()), 0o644); err != nil {
		return err
	}
	var counted []string
	if *count != "" {
		counted = strings.Split(*count, ",")
	}
	p, f, s, regressions := tally(cols, counted)
	for _, r := range regressions {
		fmt.Fprintln(stdout, "fails only with uproxy:", r)
	}
	fmt.Fprintf(stdout, "conformance: %d passed, %d failed, %d skipped\n", p, f, s)
	if len(regressions) > 0 {
		return fmt.Errorf("%d spec(s) fail with uproxy and pass with another proxy", len(regressions))
	}
	// A counted run in which no spec passed or failed proves nothing: its
	// report is missing (e2e.test did not run) or the suite's setup
	// failed and skipped everything.
	for _, c := range cols {
		if len(counted) > 0 && !slices.Contains(counted, c.name) {
			continue
		}
		ran := 0
		for _, r := range c.results {
			if r.Status == "passed" || r.Status == "failed" {
				ran++
			}
		}
		if ran == 0 {
			return fmt.Errorf("%s: no spec passed or failed (a missing JUnit report, or a suite that did not start)", c.name)
		}
	}
	return nil
}
