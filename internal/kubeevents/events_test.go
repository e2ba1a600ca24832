package kubeevents

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/uproxy/uproxy/internal/testwait"
)

// event is what the tests compare of an events.k8s.io Event.
type event struct {
	Type, Reason, Action, Controller, Note string
	Kind, Namespace, Name                  string
}

// waitEvents waits until the fake API server holds n events, and returns
// them by reason.
func waitEvents(t *testing.T, client *fake.Clientset, n int) map[string]event {
	t.Helper()
	var list *eventsv1.EventList
	testwait.Poll(10*time.Second, func() bool {
		var err error
		if list, err = client.EventsV1().Events(metav1.NamespaceAll).List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
		return len(list.Items) >= n
	})
	got := map[string]event{}
	for _, e := range list.Items {
		got[e.Reason] = eventOf(e)
	}
	return got
}

func eventOf(e eventsv1.Event) event {
	return event{Type: e.Type, Reason: e.Reason, Action: e.Action, Controller: e.ReportingController, Note: e.Note,
		Kind: e.Regarding.Kind, Namespace: e.Regarding.Namespace, Name: e.Regarding.Name}
}

// TestRecorder checks the two events uproxy reports: kube-proxy's
// Starting on the Node, and a Warning naming the error on a rejected
// Service.
func TestRecorder(t *testing.T) {
	client := fake.NewClientset()
	r := New(t.Context(), client, "node-1")
	defer r.Stop()
	r.Starting()
	svc := &v1.Service{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web", UID: "1"}}
	r.Rejected()(svc, errors.New("spec.ports[0].port: 0 is not a port"))
	want := map[string]event{
		"Starting": {Type: v1.EventTypeNormal, Reason: "Starting", Action: "StartKubeProxy", Controller: Controller,
			Kind: "Node", Name: "node-1"},
		"Rejected": {Type: v1.EventTypeWarning, Reason: "Rejected", Action: "Proxy", Controller: Controller,
			Note: "uproxy cannot proxy this object and keeps its last valid version: spec.ports[0].port: 0 is not a port",
			Kind: "Service", Namespace: "default", Name: "web"},
	}
	if diff := cmp.Diff(want, waitEvents(t, client, 2)); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
}

// TestNilRecorder checks that the nil Recorder, uproxy's without an API
// server, records nothing and gives the tracker no hook.
func TestNilRecorder(t *testing.T) {
	var r *Recorder
	r.Starting()
	if r.Rejected() != nil {
		t.Error("a nil Recorder's Rejected hook is not nil")
	}
	r.Stop()
}
