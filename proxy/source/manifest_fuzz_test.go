package source

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// The fuzz targets below run their seeds with every `go test`; `make fuzz`
// (part of `make test`) also fuzzes each for a bounded time. They check
// invariants of the code that reads user input (manifest files, Service and
// EndpointSlice fields, annotations, flags), not merely that it does not
// panic.

// manifestSeeds are manifests in forms and with mistakes beyond those of
// decodeCases and decodeErrorCases, which seed the fuzzer too.
var manifestSeeds = []string{
	strings.ReplaceAll(webYAML, "\n", "\r\n"),
	`{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"web-v6","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv6","ports":[{"name":"http","port":8080,"protocol":"TCP"}],"endpoints":[{"addresses":["2001:db8::11"],"conditions":{"ready":false,"serving":true,"terminating":true},"zone":"a","hints":{"forZones":[{"name":"a"}]}}]}`,
	`{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"n"},"spec":{"clusterIP":"10.96.0.14","ports":[{"port":53,"protocol":"UDP"}]}}]}]}`,
	`apiVersion: v1
kind: Service
metadata:
  name: lb
  namespace: edge
  annotations:
    uproxy.io/balancer: weighted-round-robin
    uproxy.io/weights: "10.244.0.11=3,10.244.0.12=1"
    uproxy.io/proxy-protocol: v2
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.15
  clusterIPs: [10.96.0.15, "2001:db8::15"]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  loadBalancerSourceRanges: [192.0.2.0/24]
  ports: [{name: https, port: 443, nodePort: 30443, targetPort: 8443}]
status:
  loadBalancer:
    ingress: [{ip: 192.0.2.10}, {ip: 192.0.2.11, ipMode: Proxy}]
`,
	"",
	"---\n---\n",
	"# only a comment\n",
	"apiVersion: v1\nkind: Endpoints\nmetadata: {name: old}\n",
	`{"apiVersion":"v1","kind":"List","items":[null]}`,
	"{}\nnull\n",
	"apiVersion: v1\nkind: Service\nmetadata: {name: x, creationTimestamp: \"2024-01-02T03:04:05.678+02:00\"}\n",
}

// FuzzDecodeManifests checks that DecodeManifests either fails with a
// *ManifestError naming the file and returns nothing, or returns objects
// that survive being written back out: re-encoded as a JSON stream and as a
// kind: List, they decode to the same objects.
func FuzzDecodeManifests(f *testing.F) {
	for _, s := range manifestSeeds {
		f.Add([]byte(s))
	}
	for _, tt := range decodeCases {
		f.Add([]byte(tt.in))
	}
	for _, tt := range decodeErrorCases {
		f.Add([]byte(tt.in))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		const file = "fuzz.yaml"
		objs, err := DecodeManifests(file, bytes.NewReader(data))
		if err != nil {
			var me *ManifestError
			if !errors.As(err, &me) || me.File != file || me.Doc < -1 {
				t.Fatalf("DecodeManifests() error = %v (%T), want a *ManifestError for %s", err, err, file)
			}
			if !strings.HasPrefix(err.Error(), file+": ") {
				t.Fatalf("error %q does not start with the file name", err)
			}
			if len(objs.Services) != 0 || len(objs.Slices) != 0 || objs.Ignored != 0 {
				t.Fatalf("DecodeManifests() returned objects with error %v: %+v", err, objs)
			}
			return
		}
		for i, s := range objs.Services {
			if s == nil || s.Namespace == "" {
				t.Fatalf("Services[%d] = %+v: nil or without a namespace", i, s)
			}
		}
		for i, s := range objs.Slices {
			if s == nil || s.Namespace == "" {
				t.Fatalf("Slices[%d] = %+v: nil or without a namespace", i, s)
			}
		}

		docs := encodeObjects(t, objs)
		stream := bytes.Join(docs, []byte("\n"))
		list := v1.List{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "List"}}
		for _, d := range docs {
			list.Items = append(list.Items, runtime.RawExtension{Raw: d})
		}
		listJSON, err := json.Marshal(list)
		if err != nil {
			t.Fatal(err)
		}
		for _, form := range []struct{ name, data string }{{"stream.json", string(stream)}, {"list.json", string(listJSON)}} {
			again, err := DecodeManifests(form.name, strings.NewReader(form.data))
			if err != nil {
				t.Fatalf("re-encoded objects do not decode: %v\ninput: %q\nre-encoded: %s", err, data, form.data)
			}
			if again.Ignored != 0 || len(again.Services) != len(objs.Services) || len(again.Slices) != len(objs.Slices) {
				t.Fatalf("%s: decoded %d services, %d slices, %d ignored; want %d, %d, 0",
					form.name, len(again.Services), len(again.Slices), again.Ignored, len(objs.Services), len(objs.Slices))
			}
			if diff := cmp.Diff(string(stream), string(bytes.Join(encodeObjects(t, again), []byte("\n")))); diff != "" {
				t.Fatalf("%s: objects changed through re-encoding (-first +second):\n%s\ninput: %q", form.name, diff, data)
			}
		}
	})
}

// encodeObjects encodes each Service and EndpointSlice of objs as a JSON
// document with its apiVersion and kind.
func encodeObjects(t *testing.T, objs Objects) [][]byte {
	t.Helper()
	var out [][]byte
	add := func(obj any) {
		b, err := json.Marshal(obj)
		if err != nil {
			t.Fatalf("cannot encode %T: %v", obj, err)
		}
		out = append(out, b)
	}
	for _, s := range objs.Services {
		c := s.DeepCopy()
		c.TypeMeta = metav1.TypeMeta{APIVersion: "v1", Kind: "Service"}
		add(c)
	}
	for _, s := range objs.Slices {
		c := s.DeepCopy()
		c.TypeMeta = metav1.TypeMeta{APIVersion: "discovery.k8s.io/v1", Kind: "EndpointSlice"}
		add(c)
	}
	return out
}
