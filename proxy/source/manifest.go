package source

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"
)

// Objects is what a set of manifests holds that uproxy uses.
type Objects struct {
	Services []*v1.Service
	Slices   []*discovery.EndpointSlice
	// Ignored counts documents of other kinds (Deployments and the like),
	// which a manifest folder may well contain.
	Ignored int
	// IgnoredKinds names the kind of each ignored document, as
	// "apiVersion/Kind", in the order found.
	IgnoredKinds []string
}

// trim trims the objects as the informers do (TrimObject), so that a
// manifest's object compares and converts as the API server's would.
func (o *Objects) trim() {
	for _, svc := range o.Services {
		TrimService(svc)
	}
	for _, sl := range o.Slices {
		TrimSlice(sl)
	}
}

func (o *Objects) add(obj runtime.Object) error {
	switch t := obj.(type) {
	case *v1.Service:
		if t.Namespace == "" {
			t.Namespace = v1.NamespaceDefault
		}
		o.Services = append(o.Services, t)
	case *discovery.EndpointSlice:
		if t.Namespace == "" {
			t.Namespace = v1.NamespaceDefault
		}
		o.Slices = append(o.Slices, t)
	case *v1.List:
		for i, item := range t.Items {
			inner, err := decodeObject(item.Raw)
			if err != nil {
				return fmt.Errorf("items[%d]: %w", i, err)
			}
			if err := o.add(inner); err != nil {
				return fmt.Errorf("items[%d]: %w", i, err)
			}
		}
	case unknownKind:
		o.Ignored++
		o.IgnoredKinds = append(o.IgnoredKinds, t.kind)
	default:
		o.Ignored++
		gvk := obj.GetObjectKind().GroupVersionKind()
		o.IgnoredKinds = append(o.IgnoredKinds, gvk.GroupVersion().String()+"/"+gvk.Kind)
	}
	return nil
}

// ManifestError says which file and which document of it could not be
// decoded, and why.
type ManifestError struct {
	File  string
	Doc   int // zero-based index of the document in the file; -1 for the file as a whole
	Cause error
}

func (e *ManifestError) Error() string {
	if e.Doc < 0 {
		return fmt.Sprintf("%s: %v", e.File, e.Cause)
	}
	return fmt.Sprintf("%s: document %d: %v", e.File, e.Doc, e.Cause)
}

func (e *ManifestError) Unwrap() error { return e.Cause }

// decodeObject decodes one YAML or JSON document into the API type its
// apiVersion and kind name, with apimachinery's universal deserializer: the
// same code path, defaults excepted, that kubectl's objects take.
func decodeObject(doc []byte) (runtime.Object, error) {
	obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
	if runtime.IsNotRegisteredError(err) {
		// The deserializer returns no kind with this error: read it
		// again, for the error that lists what a path holds.
		var tm metav1.TypeMeta
		_ = yaml.Unmarshal(doc, &tm)
		return unknownKind{kind: tm.APIVersion + "/" + tm.Kind}, nil
	}
	return obj, err
}

// unknownKind stands for a well-formed object of a kind uproxy ignores,
// named "apiVersion/Kind".
type unknownKind struct {
	runtime.Object
	kind string
}

// DecodeManifests decodes a multi-document YAML stream, a JSON object, or
// a stream of JSON objects, as read from the file named name.
func DecodeManifests(name string, r io.Reader) (Objects, error) {
	var out Objects
	data, err := io.ReadAll(r)
	if err != nil {
		return out, &ManifestError{File: name, Doc: -1, Cause: err}
	}
	docs, err := splitDocuments(data)
	if err != nil {
		return out, &ManifestError{File: name, Doc: len(docs), Cause: err}
	}
	for i, doc := range docs {
		if len(bytes.TrimSpace(doc)) == 0 || isOnlyComments(doc) {
			continue
		}
		obj, err := decodeObject(doc)
		if err == nil {
			err = out.add(obj)
		}
		if err != nil {
			return Objects{}, &ManifestError{File: name, Doc: i, Cause: err}
		}
	}
	return out, nil
}

func isOnlyComments(doc []byte) bool {
	for line := range strings.SplitSeq(string(doc), "\n") {
		l := strings.TrimSpace(line)
		if l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// splitDocuments splits YAML on "---" lines, and JSON streams object by
// object. On error it returns the documents read before the bad one.
func splitDocuments(data []byte) ([][]byte, error) {
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) > 0 && (trimmed[0] == '{' || trimmed[0] == '[') {
		var docs [][]byte
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		for {
			var raw json.RawMessage
			if err := dec.Decode(&raw); err == io.EOF {
				return docs, nil
			} else if err != nil {
				return docs, fmt.Errorf("invalid JSON: %w", err)
			}
			if len(raw) > 0 && raw[0] == '[' {
				return docs, errors.New("a JSON array is not a Kubernetes object (use kind: List)")
			}
			docs = append(docs, raw)
		}
	}
	var docs [][]byte
	rd := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := rd.Read()
		if err == io.EOF {
			return docs, nil
		}
		if err != nil {
			return docs, err
		}
		docs = append(docs, doc)
	}
}

// DefaultMaxManifestBytes is the size cap of one manifest file when
// FileSource.MaxFileBytes is zero.
const DefaultMaxManifestBytes = 64 << 20

// ManifestFiles lists the manifest files at path: path itself if it is a
// file, else the .yaml, .yml and .json files directly in it (not in
// subfolders, and not hidden ones, which is where editors and ConfigMap
// volumes keep their temporary files), sorted.
//
// Only regular files are manifests: reading a FIFO blocks until a writer
// comes, and a device such as /dev/zero never ends. A symlink counts
// as what it points to, as ConfigMap volumes link every file into their
// "..data" folder. A folder entry that is anything else is left out, and
// skipped says which and why; path itself being anything else is an error.
func ManifestFiles(path string) (files []string, skipped []error, err error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, nil, err
	}
	if !fi.IsDir() {
		if !fi.Mode().IsRegular() {
			return nil, nil, notRegular(path, fi.Mode())
		}
		return []string{path}, nil, nil
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".") || !isManifestName(name) {
			continue
		}
		full := filepath.Join(path, name)
		st, err := os.Stat(full)
		switch {
		case err != nil:
			skipped = append(skipped, fmt.Errorf("%s: %w", full, err)) // a dangling symlink
		case st.IsDir():
			// A folder named like a file: not a manifest, and not worth a word.
		case !st.Mode().IsRegular():
			skipped = append(skipped, notRegular(full, st.Mode()))
		default:
			files = append(files, full)
		}
	}
	slices.Sort(files)
	return files, skipped, nil
}

func notRegular(file string, mode os.FileMode) error {
	return fmt.Errorf("%s: not a regular file (%s)", file, fileKind(mode))
}

// fileKind names what a non-regular file is, for error messages.
func fileKind(mode os.FileMode) string {
	switch t := mode.Type(); {
	case t&os.ModeNamedPipe != 0:
		return "a named pipe"
	case t&os.ModeCharDevice != 0:
		return "a character device"
	case t&os.ModeDevice != 0:
		return "a block device"
	case t&os.ModeSocket != 0:
		return "a socket"
	case t&os.ModeDir != 0:
		return "a folder"
	default:
		return "mode " + t.String()
	}
}

func isManifestName(name string) bool {
	switch strings.ToLower(filepath.Ext(name)) {
	case ".yaml", ".yml", ".json":
		return true
	}
	return false
}

// LoadManifestFile decodes one file, which must be a regular file of at
// most limit bytes (zero or less means DefaultMaxManifestBytes). The file
// is opened without blocking and checked once open, so that one swapped
// for a FIFO or a device after ManifestFiles listed it is refused too.
// The objects are trimmed as the informers trim theirs (TrimObject).
func LoadManifestFile(file string, limit int64) (Objects, error) {
	if limit <= 0 {
		limit = DefaultMaxManifestBytes
	}
	// O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer.
	// It changes nothing for a regular file.
	f, err := os.OpenFile(file, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return Objects{}, &ManifestError{File: file, Doc: -1, Cause: err}
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return Objects{}, &ManifestError{File: file, Doc: -1, Cause: err}
	}
	if !fi.Mode().IsRegular() {
		return Objects{}, &ManifestError{File: file, Doc: -1, Cause: fmt.Errorf("not a regular file (%s)", fileKind(fi.Mode()))}
	}
	// The size may grow between Stat and the read: the read is capped too.
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return Objects{}, &ManifestError{File: file, Doc: -1, Cause: err}
	}
	if int64(len(data)) > limit {
		return Objects{}, &ManifestError{File: file, Doc: -1, Cause: fmt.Errorf("larger than the %d-byte limit for one manifest file", limit)}
	}
	objs, err := DecodeManifests(file, bytes.NewReader(data))
	if err != nil {
		return Objects{}, err
	}
	objs.trim()
	return objs, nil
}
