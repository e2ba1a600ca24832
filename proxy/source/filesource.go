package source

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
)

// FileSource feeds a Tracker from Service and EndpointSlice manifests in a
// file or a folder, and reloads them when they change.
//
// Each file is kept as it last decoded without error: a file that turns
// malformed keeps serving its last good objects (and its error is logged),
// while changes in the other files still apply.
type FileSource struct {
	// Path is a manifest file or a folder of them.
	Path string
	// Tracker receives the objects.
	Tracker *changes.Tracker
	// Logger; nil means none.
	Logger *zap.Logger
	// Debounce batches bursts of file events (editors write, rename and
	// chmod in quick succession); zero means 100ms.
	Debounce time.Duration
	// MaxFileBytes caps the size of one manifest file: a larger one is an
	// error naming it. Zero means DefaultMaxManifestBytes.
	MaxFileBytes int64

	good map[string]Objects // last good decoding of each file
}

// Load reads every manifest once and hands the result to the tracker. An
// error names the file and document and means nothing was loaded: at
// startup the caller should exit, so a typo is not mistaken for "no
// services".
func (s *FileSource) Load() error {
	files, err := s.files()
	if err != nil {
		return fmt.Errorf("reading manifests: %w", err)
	}
	good := map[string]Objects{}
	for _, f := range files {
		objs, err := LoadManifestFile(f, s.MaxFileBytes)
		if err != nil {
			return err
		}
		good[f] = objs
	}
	if err := checkNotEmpty(s.Path, files, good); err != nil {
		return err
	}
	s.good = good
	s.publish()
	return nil
}

// checkNotEmpty fails when the manifests at startup hold no Service and
// no EndpointSlice: a path that names the wrong thing (kube-proxy's
// configuration file, a folder of Deployments) must not start a proxy
// that serves nothing and reports healthy. The error names what was
// found instead.
func checkNotEmpty(path string, files []string, good map[string]Objects) error {
	var kinds []string
	for _, f := range files {
		o := good[f]
		if len(o.Services) > 0 || len(o.Slices) > 0 {
			return nil
		}
		for _, k := range o.IgnoredKinds {
			kinds = append(kinds, fmt.Sprintf("%s in %s", k, f))
		}
	}
	switch {
	case len(files) == 0:
		return fmt.Errorf("%s: no manifest files (*.yaml, *.yml, *.json): no Service and no EndpointSlice to serve", path)
	case len(kinds) == 0:
		return fmt.Errorf("%s: %d manifest files, no Service and no EndpointSlice in them (every document is empty)", path, len(files))
	}
	err := fmt.Errorf("%s: no Service and no EndpointSlice, only %s", path, strings.Join(kinds, ", "))
	for _, k := range kinds {
		if strings.HasPrefix(k, "kubeproxy.config.k8s.io/") {
			return fmt.Errorf("%w: a KubeProxyConfiguration is kube-proxy's configuration file; pass it with --config, and Service manifests with --manifests", err)
		}
	}
	return err
}

// reload re-reads every file, keeping the last good objects of files that
// fail to decode, and publishes the result.
func (s *FileSource) reload() {
	files, err := s.files()
	if err != nil {
		s.logger().Error("reading manifests failed; keeping the last good state", zap.String("path", s.Path), zap.Error(err))
		return
	}
	good := map[string]Objects{}
	for _, f := range files {
		objs, err := LoadManifestFile(f, s.MaxFileBytes)
		if err != nil {
			var me *ManifestError
			if errors.As(err, &me) && errors.Is(me.Cause, os.ErrNotExist) {
				continue // removed between listing and reading
			}
			s.logger().Error("cannot load a manifest; keeping its last good objects", zap.Error(err))
			if old, ok := s.good[f]; ok {
				good[f] = old
			}
			continue
		}
		good[f] = objs
	}
	s.good = good
	s.publish()
}

// files lists the manifest files, logging those it skips.
func (s *FileSource) files() ([]string, error) {
	files, skipped, err := ManifestFiles(s.Path)
	for _, err := range skipped {
		s.logger().Warn("skipping a manifest entry that is not a regular file", zap.Error(err))
	}
	return files, err
}

func (s *FileSource) logger() *zap.Logger {
	if s.Logger == nil {
		return zap.NewNop()
	}
	return s.Logger
}

// publish merges the files' objects and replaces the tracker's state. An
// object defined in two files is kept from the first file (sorted by name)
// and the duplicate is logged.
func (s *FileSource) publish() {
	files := make([]string, 0, len(s.good))
	for f := range s.good {
		files = append(files, f)
	}
	slices.Sort(files)
	var svcs []*v1.Service
	var slcs []*discovery.EndpointSlice
	seenSvc := map[types.NamespacedName]string{}
	seenSlice := map[types.NamespacedName]string{}
	for _, f := range files {
		o := s.good[f]
		for _, svc := range o.Services {
			k := service.NameOf(svc.Namespace, svc.Name)
			if first, dup := seenSvc[k]; dup {
				s.logger().Error("duplicate Service; keeping the first", zap.Stringer("service", k), zap.String("file", f), zap.String("first", first))
				continue
			}
			seenSvc[k] = f
			svcs = append(svcs, svc)
		}
		for _, sl := range o.Slices {
			k := service.NameOf(sl.Namespace, sl.Name)
			if first, dup := seenSlice[k]; dup {
				s.logger().Error("duplicate EndpointSlice; keeping the first", zap.Stringer("endpointSlice", k), zap.String("file", f), zap.String("first", first))
				continue
			}
			seenSlice[k] = f
			slcs = append(slcs, sl)
		}
	}
	s.Tracker.Replace(svcs, slcs)
}

// Watch reloads on every change under Path until ctx is done. It watches
// the folder (for a file, its parent folder) rather than the files, so that
// files replaced by rename (editors, kubectl cp, ConfigMap volume updates)
// are seen. The caller owns the goroutine that runs Watch.
func (s *FileSource) Watch(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watching manifests: %w", err)
	}
	defer w.Close()
	dir := s.Path
	if fi, err := os.Stat(s.Path); err == nil && !fi.IsDir() {
		dir = filepath.Dir(s.Path)
	}
	if err := w.Add(dir); err != nil {
		return fmt.Errorf("watching %s: %w", dir, err)
	}
	debounce := s.Debounce
	if debounce <= 0 {
		debounce = 100 * time.Millisecond
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return nil
			}
			if s.relevant(ev.Name) {
				timer.Reset(debounce)
			}
		case err, ok := <-w.Errors:
			if !ok {
				return nil
			}
			// An overflow loses events: reload everything to be safe.
			s.logger().Warn("file watch error; reloading", zap.Error(err))
			timer.Reset(debounce)
		case <-timer.C:
			s.logger().Info("manifests changed; reloading", zap.String("path", s.Path))
			s.reload()
		}
	}
}

// relevant reports whether an event on name may change what Load reads.
func (s *FileSource) relevant(name string) bool {
	if fi, err := os.Stat(s.Path); err == nil && !fi.IsDir() {
		return filepath.Clean(name) == filepath.Clean(s.Path)
	}
	base := filepath.Base(name)
	// ConfigMap volumes swap a "..data" symlink; anything else hidden is
	// an editor's scratch file.
	return isManifestName(base) || base == "..data"
}
