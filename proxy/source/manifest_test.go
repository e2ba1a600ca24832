package source

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
)

const webYAML = `# a comment before the first document
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: 80
    targetPort: web-http
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
endpoints:
- addresses: ["10.244.0.11"]
---
# only a comment
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, image: nginx}]}
`

// decodeCases are valid manifests in each form DecodeManifests reads
// (FuzzDecodeManifests seeds from them too).
var decodeCases = []struct {
	name                          string
	in                            string
	wantSvcs, wantSlices, ignored []string
}{
	{"multi-document YAML", webYAML, []string{"default/web"}, []string{"default/web-abc"}, []string{"1"}},
	{"JSON object", `{"apiVersion":"v1","kind":"Service","metadata":{"name":"db","namespace":"data"},"spec":{"clusterIP":"10.96.0.11","ports":[{"port":5432}]}}`,
		[]string{"data/db"}, nil, []string{"0"}},
	{"JSON stream", `{"apiVersion":"v1","kind":"Service","metadata":{"name":"a"},"spec":{"clusterIP":"10.96.0.12","ports":[{"port":1}]}}
{"apiVersion":"v1","kind":"Service","metadata":{"name":"b"},"spec":{"clusterIP":"10.96.0.13","ports":[{"port":1}]}}`,
		[]string{"default/a", "default/b"}, nil, []string{"0"}},
	{"List", `apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a}
  spec: {clusterIP: 10.96.0.12, ports: [{port: 1}]}
- apiVersion: example.com/v1
  kind: Widget
  metadata: {name: w}
`, []string{"default/a"}, nil, []string{"1"}},
}

func TestDecodeManifests(t *testing.T) {
	for _, tt := range decodeCases {
		t.Run(tt.name, func(t *testing.T) {
			objs, err := DecodeManifests("x.yaml", strings.NewReader(tt.in))
			if err != nil {
				t.Fatal(err)
			}
			var svcs, slices []string
			for _, s := range objs.Services {
				svcs = append(svcs, s.Namespace+"/"+s.Name)
			}
			for _, s := range objs.Slices {
				slices = append(slices, s.Namespace+"/"+s.Name)
			}
			got := [][]string{svcs, slices, {itoa(objs.Ignored)}}
			want := [][]string{tt.wantSvcs, tt.wantSlices, tt.ignored}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func itoa(n int) string { return string(rune('0' + n)) }

// decodeErrorCases are malformed manifests and the error each must give
// (FuzzDecodeManifests seeds from them too).
var decodeErrorCases = []struct {
	name, in, want string
}{
	{"bad YAML in second document", webYAML[:strings.Index(webYAML, "---")] + "---\nkind: Service\n  bad: [indent\n", "in.yaml: document 1:"},
	{"missing kind", "apiVersion: v1\nmetadata: {name: x}\n", "in.yaml: document 0: Object 'Kind' is missing"},
	{"wrong field type", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: eighty}]}\n", "in.yaml: document 0:"},
	{"truncated JSON", `{"apiVersion":"v1","kind":"Service"`, "in.yaml: document 0: invalid JSON"},
	{"JSON array", `[{"kind":"Service"}]`, "a JSON array is not a Kubernetes object"},
}

func TestDecodeManifestsErrors(t *testing.T) {
	for _, tt := range decodeErrorCases {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeManifests("in.yaml", strings.NewReader(tt.in))
			var me *ManifestError
			if !errors.As(err, &me) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("DecodeManifests() error = %v, want a *ManifestError containing %q", err, tt.want)
			}
		})
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	// Write then rename, as editors and ConfigMap volumes do, so a reader
	// never sees a half-written file.
	tmp := filepath.Join(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func trackedNames(tr *changes.Tracker) (svcs, slices []string) {
	for _, st := range tr.Take(true, nil).Services {
		if st.Service != nil {
			svcs = append(svcs, st.Name.String())
		}
		for _, s := range st.Slices {
			slices = append(slices, s.Namespace+"/"+s.Name)
		}
	}
	return svcs, slices
}

func TestFileSourceReload(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "web.yaml"), webYAML)
	writeFile(t, filepath.Join(dir, "db.json"), `{"apiVersion":"v1","kind":"Service","metadata":{"name":"db"},"spec":{"clusterIP":"10.96.0.11","ports":[{"port":5432}]}}`)
	writeFile(t, filepath.Join(dir, "notes.txt"), "not a manifest")

	changed := make(chan struct{}, 100)
	tr := changes.NewTracker(nil, func() { changed <- struct{}{} })
	fs := &FileSource{Path: dir, Tracker: tr, Debounce: 10 * time.Millisecond}
	if err := fs.Load(); err != nil {
		t.Fatal(err)
	}
	if !tr.Synced() {
		t.Fatal("tracker not synced after Load")
	}
	svcs, slices := trackedNames(tr)
	if diff := cmp.Diff([][]string{{"default/db", "default/web"}, {"default/web-abc"}}, [][]string{svcs, slices}); diff != "" {
		t.Fatalf("after Load (-want +got):\n%s", diff)
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- fs.Watch(ctx) }()
	defer func() { cancel(); <-done }()
	time.Sleep(50 * time.Millisecond) // let the watch start

	waitFor := func(what string, cond func(svcs, slices []string) bool) {
		t.Helper()
		testwait.UntilOK(t, 5*time.Second, what, func() (bool, string) {
			s, sl := trackedNames(tr)
			return cond(s, sl), fmt.Sprintf("services %v, slices %v", s, sl)
		})
	}

	// A malformed edit keeps that file's last good objects...
	writeFile(t, filepath.Join(dir, "web.yaml"), "apiVersion: v1\nkind: Service\nmetadata: [broken\n")
	// ...while another file's change still applies.
	writeFile(t, filepath.Join(dir, "cache.yaml"), "apiVersion: v1\nkind: Service\nmetadata: {name: cache}\nspec: {clusterIP: 10.96.0.12, ports: [{port: 6379}]}\n")
	waitFor("cache to appear with web kept", func(s, sl []string) bool {
		return cmp.Equal(s, []string{"default/cache", "default/db", "default/web"}) && cmp.Equal(sl, []string{"default/web-abc"})
	})

	// Removing a file removes its objects.
	if err := os.Remove(filepath.Join(dir, "db.json")); err != nil {
		t.Fatal(err)
	}
	waitFor("db to go", func(s, sl []string) bool { return cmp.Equal(s, []string{"default/cache", "default/web"}) })

	// Fixing the file applies its new content.
	writeFile(t, filepath.Join(dir, "web.yaml"), strings.Replace(webYAML, "name: web-abc", "name: web-xyz", 1))
	waitFor("web-xyz", func(s, sl []string) bool { return cmp.Equal(sl, []string{"default/web-xyz"}) })
}

func TestFileSourceLoadErrorNamesFile(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "a.yaml"), webYAML)
	writeFile(t, filepath.Join(dir, "b.yaml"), webYAML+"---\napiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: {}}\n")
	fs := &FileSource{Path: dir, Tracker: changes.NewTracker(nil, nil)}
	err := fs.Load()
	want := filepath.Join(dir, "b.yaml") + ": document 4:"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Load() = %v, want an error starting %q", err, want)
	}
	if fs.Tracker.Synced() {
		t.Error("a failed Load must not mark the tracker synced")
	}
	if err := (&FileSource{Path: filepath.Join(dir, "missing"), Tracker: changes.NewTracker(nil, nil)}).Load(); err == nil {
		t.Error("Load of a missing path succeeded")
	}
}

// TestFileSourceOnlyRegularFiles checks that a manifest folder reads
// regular files only: a FIFO would block the load until a writer
// came, /dev/zero would be read until memory ran out. Each skipped entry
// is logged by name, and a symlink to a regular file is followed, as
// ConfigMap volumes need.
func TestFileSourceOnlyRegularFiles(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "web.yaml"), webYAML)
	outside := filepath.Join(t.TempDir(), "db.yaml")
	writeFile(t, outside, "apiVersion: v1\nkind: Service\nmetadata: {name: db}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 5432}]}\n")
	if err := os.Symlink(outside, filepath.Join(dir, "db.yaml")); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	zero := filepath.Join(dir, "zero.yaml")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}

	core, logs := observer.New(zap.WarnLevel)
	tr := changes.NewTracker(nil, nil)
	fs := &FileSource{Path: dir, Tracker: tr, Logger: zap.New(core)}
	loaded := make(chan error, 1)
	go func() { loaded <- fs.Load() }()
	select {
	case err := <-loaded:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		// Unblock a reader stuck on the FIFO before failing.
		if w, err := os.OpenFile(fifo, os.O_WRONLY, 0); err == nil {
			w.Close()
		}
		t.Fatal("Load did not return within 5s")
	}
	svcs, _ := trackedNames(tr)
	if diff := cmp.Diff([]string{"default/db", "default/web"}, svcs); diff != "" {
		t.Errorf("services (-want +got):\n%s", diff)
	}
	var skipped []string
	for _, e := range logs.All() {
		skipped = append(skipped, e.Message+": "+e.ContextMap()["error"].(string))
	}
	want := []string{
		"skipping a manifest entry that is not a regular file: " + fifo + ": not a regular file (a named pipe)",
		"skipping a manifest entry that is not a regular file: " + zero + ": not a regular file (a character device)",
	}
	if diff := cmp.Diff(want, skipped); diff != "" {
		t.Errorf("log lines (-want +got):\n%s", diff)
	}

	// A file swapped for a FIFO or a device after it was listed is refused
	// when it is opened, without blocking.
	for _, f := range []string{fifo, zero} {
		_, err := LoadManifestFile(f, 0)
		var me *ManifestError
		if !errors.As(err, &me) || me.File != f || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("LoadManifestFile(%s) = %v, want a ManifestError naming the file: not a regular file", f, err)
		}
	}
	// So is a --manifests that names one of them.
	if err := (&FileSource{Path: fifo, Tracker: changes.NewTracker(nil, nil)}).Load(); err == nil || !strings.Contains(err.Error(), fifo+": not a regular file") {
		t.Errorf("Load of a FIFO path = %v, want an error naming it", err)
	}
}

// TestFileSourceSizeCap checks that a manifest file over the size cap is
// an error naming the file, and that a reload keeps the last good objects
// of a file that outgrows it.
func TestFileSourceSizeCap(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "web.yaml")
	writeFile(t, file, webYAML)
	limit := int64(len(webYAML))
	tr := changes.NewTracker(nil, nil)
	fs := &FileSource{Path: dir, Tracker: tr, MaxFileBytes: limit}
	if err := fs.Load(); err != nil {
		t.Fatalf("Load of a file at the limit: %v", err)
	}
	writeFile(t, file, webYAML+"\n# one byte too many is more than enough\n")
	fs.reload()
	if svcs, _ := trackedNames(tr); !cmp.Equal(svcs, []string{"default/web"}) {
		t.Errorf("after a reload over the limit, services %v, want web kept", svcs)
	}
	err := fs.Load()
	if err == nil || !strings.Contains(err.Error(), file+": larger than the "+strconv.FormatInt(limit, 10)+"-byte limit") {
		t.Errorf("Load over the limit = %v, want an error naming %s and the limit", err, file)
	}
}
