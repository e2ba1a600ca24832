package source

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
)

// TestKubeSourceTrims checks that the objects the informers hand the
// tracker are trimmed: no managed fields, no foreign annotations,
// no target references, while what uproxy reads is kept.
func TestKubeSourceTrims(t *testing.T) {
	svc, sls := filledService(1), filledSlices(1)
	svc.Namespace, sls[0].Namespace, sls[1].Namespace = "default", "default", "default"
	client := fake.NewClientset(svc, sls[0], sls[1])
	tr := changes.NewTracker(nil, nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- (&KubeSource{Client: client, Tracker: tr}).Run(ctx) }() // ends with ctx
	defer func() { cancel(); <-done }()
	testwait.Until(t, 10*time.Second, "the initial lists", tr.Synced)
	gotSvcs, gotSls := tr.Objects()
	if len(gotSvcs) != 1 || len(gotSls) != 2 {
		t.Fatalf("the tracker holds %d Services and %d EndpointSlices, want 1 and 2", len(gotSvcs), len(gotSls))
	}
	wantSvc, wantSls := trimmedCopy(svc, sls)
	opts := cmpopts.IgnoreTypes(metav1.TypeMeta{})
	if diff := cmp.Diff(wantSvc, gotSvcs[0], opts); diff != "" {
		t.Errorf("the Service the tracker holds is not the trimmed one (-want +got):\n%s", diff)
	}
	for i := range wantSls {
		if diff := cmp.Diff(wantSls[i], gotSls[i], opts); diff != "" {
			t.Errorf("EndpointSlice %d the tracker holds is not the trimmed one (-want +got):\n%s", i, diff)
		}
	}
	if len(gotSvcs[0].ManagedFields) != 0 || gotSls[0].Endpoints[0].TargetRef != nil {
		t.Errorf("managed fields or target references reached the tracker")
	}
}
