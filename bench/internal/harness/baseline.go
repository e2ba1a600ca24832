package harness

import (
	"context"
	"debug/buildinfo"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// HasBaseline reports whether the run compares against a baseline binary.
func (c Config) HasBaseline() bool { return c.Baseline != "" || c.BaselineRev != "" }

// baselineBin is the uproxy binary that the current one is compared with.
type baselineBin struct {
	// Path is the binary, named uproxy (as perf groups its samples by
	// process name).
	Path string
	// From says where it came from: "--baseline PATH" or "--baseline-rev REV".
	From string
	// Commit is the commit it was built from, or "unknown".
	Commit string
}

func (b *baselineBin) describe() string { return fmt.Sprintf("%s (commit %s)", b.From, b.Commit) }

// prepareBaseline makes the baseline binary at dir/uproxy: a link to
// --baseline, or built from --baseline-rev.
func prepareBaseline(ctx context.Context, cfg Config, dir string) (*baselineBin, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	out := filepath.Join(dir, "uproxy")
	if cfg.BaselineRev != "" {
		commit, err := buildRev(ctx, cfg.Root, cfg.BaselineRev, out)
		if err != nil {
			return nil, fmt.Errorf("--baseline-rev %s: %w", cfg.BaselineRev, err)
		}
		return &baselineBin{Path: out, From: "--baseline-rev " + cfg.BaselineRev, Commit: commit}, nil
	}
	abs, err := filepath.Abs(cfg.Baseline)
	if err != nil {
		return nil, fmt.Errorf("--baseline %s: %w", cfg.Baseline, err)
	}
	st, err := os.Stat(abs)
	if err != nil {
		return nil, fmt.Errorf("--baseline: %w", err)
	}
	if st.IsDir() || st.Mode().Perm()&0o111 == 0 {
		return nil, fmt.Errorf("--baseline %s: not an executable file", cfg.Baseline)
	}
	// A symbolic link gives the process the name uproxy, whatever the
	// file is called.
	if err := os.Symlink(abs, out); err != nil {
		return nil, fmt.Errorf("--baseline: %w", err)
	}
	return &baselineBin{Path: out, From: "--baseline " + cfg.Baseline, Commit: binaryCommit(abs)}, nil
}

// buildRev builds ./cmd/uproxy from revision rev of the git checkout at
// root into out, and returns the commit's short hash. The tree is
// exported with git archive, which reads the repository and changes
// nothing in it (no worktree, no checkout).
func buildRev(ctx context.Context, root, rev, out string) (string, error) {
	hash, err := exec.CommandContext(ctx, "git", "-C", root, "rev-parse", "--verify", "--short", rev+"^{commit}").Output()
	if err != nil {
		return "", fmt.Errorf("not a commit of %s: %w", root, exitDetail(err))
	}
	src, err := os.MkdirTemp("", "uproxy-bench-baseline-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(src)
	archive := exec.CommandContext(ctx, "git", "-C", root, "archive", "--format=tar", rev+"^{commit}")
	untar := exec.CommandContext(ctx, "tar", "-x", "-C", src)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return "", err
	}
	untar.Stdin = pipe
	var archiveErr, untarErr strings.Builder
	archive.Stderr, untar.Stderr = &archiveErr, &untarErr
	if err := untar.Start(); err != nil {
		return "", fmt.Errorf("tar: %w", err)
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return "", fmt.Errorf("git archive: %w: %s", err, strings.TrimSpace(archiveErr.String()))
	}
	if err := untar.Wait(); err != nil {
		return "", fmt.Errorf("tar -x: %w: %s", err, strings.TrimSpace(untarErr.String()))
	}
	if err := GoBuild(ctx, src, out, "./cmd/uproxy"); err != nil {
		return "", err
	}
	return strings.TrimSpace(string(hash)), nil
}

// exitDetail adds a failed command's standard error to its error.
func exitDetail(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
	}
	return err
}

// binaryCommit returns the commit a Go binary was built from (its build
// information's vcs.revision, shortened), or "unknown".
func binaryCommit(path string) string {
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return "unknown"
	}
	rev, modified := "", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev == "" {
		return "unknown"
	}
	if len(rev) > 7 {
		rev = rev[:7]
	}
	if modified {
		rev += " + uncommitted changes"
	}
	return rev
}
