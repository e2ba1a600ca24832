package datapath

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// TestRawCallsPassNoPointer checks, as a vet pass would, that no pointer
// converted to uintptr is passed to a Go function: only the assembly
// system call entry points keep the memory of such an argument alive and
// in place for the call (unsafe.Pointer's rule 4). rawCall took its
// buffers, sockaddrs and msghdrs that way, and a stack that grew in it
// moved them away from the addresses the kernel was given.
func TestRawCallsPassNoPointer(t *testing.T) {
	// The functions implemented in assembly that the package calls.
	asm := map[string]bool{
		"unix.RawSyscall": true, "unix.RawSyscall6": true, "unix.Syscall": true, "unix.Syscall6": true,
		"syscall.RawSyscall": true, "syscall.RawSyscall6": true, "syscall.Syscall": true, "syscall.Syscall6": true,
	}
	conversions := map[string]bool{"uintptr": true, "uint64": true, "uint32": true, "int": true, "int64": true}
	var files []string
	for _, dir := range []string{".", "../internal/uring"} {
		m, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range m {
			if !strings.HasSuffix(f, "_test.go") {
				files = append(files, f)
			}
		}
	}
	fset := token.NewFileSet()
	var bad []string
	for _, name := range files {
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			fn := exprString(call.Fun)
			if asm[fn] || conversions[fn] {
				return true
			}
			for _, a := range call.Args {
				if isPointerAsUintptr(a) {
					bad = append(bad, fset.Position(a.Pos()).String()+": a pointer passed as uintptr to "+fn)
				}
			}
			return true
		})
	}
	if len(files) < 10 {
		t.Fatalf("checked only %d files: %v", len(files), files)
	}
	for _, b := range bad {
		t.Error(b)
	}
}

// isPointerAsUintptr reports whether e is uintptr(unsafe.Pointer(…)).
func isPointerAsUintptr(e ast.Expr) bool {
	c, ok := ast.Unparen(e).(*ast.CallExpr)
	if !ok || exprString(c.Fun) != "uintptr" || len(c.Args) != 1 {
		return false
	}
	inner, ok := ast.Unparen(c.Args[0]).(*ast.CallExpr)
	return ok && exprString(inner.Fun) == "unsafe.Pointer"
}

// exprString renders a function expression: a name, or pkg.Name.
func exprString(e ast.Expr) string {
	switch e := ast.Unparen(e).(type) {
	case *ast.Ident:
		return e.Name
	case *ast.SelectorExpr:
		return exprString(e.X) + "." + e.Sel.Name
	}
	return ""
}
