package testkube

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"k8s.io/utils/ptr"
)

// Apply server-side-applies every object in the YAML files (as
// `kubectl apply --server-side` would, with field manager "uproxy-tests").
func (cp *ControlPlane) Apply(ctx context.Context, files ...string) error {
	dc, err := discovery.NewDiscoveryClientForConfig(cp.RESTConfig)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(cp.RESTConfig)
	if err != nil {
		return err
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		rd := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
		for i := 0; ; i++ {
			doc, err := rd.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return fmt.Errorf("%s: document %d: %w", f, i, err)
			}
			obj := &unstructured.Unstructured{}
			if err := utilyaml.Unmarshal(doc, &obj.Object); err != nil {
				return fmt.Errorf("%s: document %d: %w", f, i, err)
			}
			if len(obj.Object) == 0 {
				continue
			}
			gvk := obj.GroupVersionKind()
			m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				return fmt.Errorf("%s: document %d (%s): %w", f, i, gvk, err)
			}
			var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
			if ns := obj.GetNamespace(); ns != "" {
				ri = dyn.Resource(m.Resource).Namespace(ns)
			}
			body, err := obj.MarshalJSON()
			if err != nil {
				return err
			}
			if _, err := ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, body, metav1.PatchOptions{FieldManager: "uproxy-tests", Force: ptr.To(true)}); err != nil {
				return fmt.Errorf("applying %s %s/%s from %s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), f, err)
			}
		}
	}
	return nil
}
