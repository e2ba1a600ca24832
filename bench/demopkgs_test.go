package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// execTracer stands in for PATH while a command runs: every program on the
// real PATH is replaced by a script that records its name and real path,
// then executes it. Programs started by absolute path are not seen, and
// need none: they are the demo's own binaries.
type execTracer struct {
	dir string // the shims, the only folder on the traced PATH
	log string // one "name<TAB>real path" line per execution
}

// newExecTracer writes a shim into a new folder for each executable that
// path (a PATH value) resolves, the first one found winning as in a lookup.
func newExecTracer(t *testing.T, path string) *execTracer {
	t.Helper()
	tr := &execTracer{dir: t.TempDir(), log: filepath.Join(t.TempDir(), "exec.log")}
	seen := map[string]bool{}
	for _, dir := range filepath.SplitList(path) {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			name := e.Name()
			if seen[name] || strings.ContainsAny(name, "'\n") {
				continue
			}
			real := filepath.Join(dir, name)
			if st, err := os.Stat(real); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
				continue
			}
			seen[name] = true
			script := fmt.Sprintf("#!/bin/sh\nprintf '%%s\\t%%s\\n' '%s' '%s' >>'%s'\nexec '%s' \"$@\"\n", name, real, tr.log, real)
			if err := os.WriteFile(filepath.Join(tr.dir, name), []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	return tr
}

// env returns environ with PATH replaced by the shims' folder.
func (tr *execTracer) env(environ []string) []string {
	env := slices.DeleteFunc(slices.Clone(environ), func(kv string) bool { return strings.HasPrefix(kv, "PATH=") })
	return append(env, "PATH="+tr.dir)
}

// ran returns the real paths of the programs executed so far, sorted and
// without repeats.
func (tr *execTracer) ran(t *testing.T) []string {
	t.Helper()
	f, err := os.Open(tr.log)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var paths []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if _, real, ok := strings.Cut(sc.Text(), "\t"); ok && !slices.Contains(paths, real) {
			paths = append(paths, real)
		}
	}
	slices.Sort(paths)
	return paths
}

// debianPackage returns the Debian package that installed the program at
// path, following symbolic links (the alternatives system's among them) to
// the file a package owns. On a merged-/usr system dpkg may know a file
// by its /bin, /sbin or /lib name, so both names are asked.
func debianPackage(path string) (string, error) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", err
	}
	var errs []string
	for _, p := range usrMergeNames(path, real) {
		out, err := exec.Command("dpkg-query", "-S", p).Output()
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", p, err))
			continue
		}
		// "pkg[:arch][, pkg2]: /path"
		pkg, _, _ := strings.Cut(string(out), ": ")
		pkg, _, _ = strings.Cut(pkg, ",")
		pkg, _, _ = strings.Cut(pkg, ":")
		return strings.TrimSpace(pkg), nil
	}
	return "", fmt.Errorf("no Debian package owns %s (%s)", path, strings.Join(errs, "; "))
}

// usrMergeNames returns the names under which dpkg may know the file
// reached through path, whose symbolic links lead to real.
func usrMergeNames(path, real string) []string {
	var names []string
	for _, p := range []string{real, path} {
		names = append(names, p)
		if rest, ok := strings.CutPrefix(p, "/usr"); ok {
			names = append(names, rest)
		} else {
			names = append(names, "/usr"+p)
		}
	}
	return names
}

// essential reports whether Debian marks pkg Essential: present on every
// installation, so a target need not install it.
func essential(pkg string) bool {
	out, err := exec.Command("dpkg-query", "-W", "-f=${Essential}", pkg).Output()
	return err == nil && strings.TrimSpace(string(out)) == "yes"
}

// makeVar returns the words of a `NAME := …` line of the Makefile.
func makeVar(makefile []byte, name string) []string {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s*:?=(.*)$`).FindSubmatch(makefile)
	if m == nil {
		return nil
	}
	return strings.Fields(string(m[1]))
}

// checkDemoPackages fails t for each program the demo ran whose Debian
// package `make deps-demo` would not install on a fresh machine.
func checkDemoPackages(t *testing.T, ran []string) {
	t.Helper()
	if _, err := exec.LookPath("dpkg-query"); err != nil {
		t.Logf("not checking the demo's packages: no dpkg-query (not Debian): %v", err)
		return
	}
	mk, err := os.ReadFile("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	demoPkgs := makeVar(mk, "DEMO_PKGS")
	if len(demoPkgs) == 0 {
		t.Fatal("the Makefile has no DEMO_PKGS line")
	}
	if len(ran) == 0 {
		t.Fatal("the demo ran no program through PATH: the tracer saw nothing, so it checked nothing")
	}
	for _, p := range ran {
		pkg, err := debianPackage(p)
		switch {
		case err != nil:
			t.Errorf("the demo ran %s: %v; make deps-demo cannot install it", p, err)
		case !slices.Contains(demoPkgs, pkg) && !essential(pkg):
			t.Errorf("the demo ran %s, from Debian package %s, which DEMO_PKGS in the Makefile (%s) does not install", p, pkg, strings.Join(demoPkgs, " "))
		default:
			t.Logf("the demo ran %s (package %s)", p, pkg)
		}
	}
}

func TestMakeVar(t *testing.T) {
	mk := []byte("X := a\nDEMO_PKGS := iptables iproute2 ipset curl\nTEST_PKGS := $(DEMO_PKGS) socat\nOTHER_DEMO_PKGS := no\n")
	for _, tc := range []struct {
		name string
		want []string
	}{
		{"DEMO_PKGS", []string{"iptables", "iproute2", "ipset", "curl"}},
		{"TEST_PKGS", []string{"$(DEMO_PKGS)", "socat"}},
		{"MISSING", nil},
	} {
		if diff := cmp.Diff(tc.want, makeVar(mk, tc.name)); diff != "" {
			t.Errorf("makeVar(%s) (-want +got):\n%s", tc.name, diff)
		}
	}
}

func TestUsrMergeNames(t *testing.T) {
	got := usrMergeNames("/usr/sbin/iptables", "/usr/sbin/xtables-nft-multi")
	want := []string{"/usr/sbin/xtables-nft-multi", "/sbin/xtables-nft-multi", "/usr/sbin/iptables", "/sbin/iptables"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("usrMergeNames (-want +got):\n%s", diff)
	}
}
