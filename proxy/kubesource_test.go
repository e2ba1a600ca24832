package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
)

// TestKubeSourceSyncedAfterEveryObject checks that the initial lists
// count as received only once the handlers have seen every object in
// them: an informer has synced as soon as its cache holds the lists,
// while its handlers may still be working through them, and a first sync
// would then program services without their endpoints. The tracker is
// held locked, so the handlers cannot record anything: the lists must
// not be reported received until it is released.
func TestKubeSourceSyncedAfterEveryObject(t *testing.T) {
	const n = 2000
	var objs []runtime.Object
	for i := range n {
		name := fmt.Sprintf("svc-%04d", i)
		objs = append(objs, svc(name, fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), "http:80"),
			slice(name+"-1", name, "http", 8080, ep{ip: fmt.Sprintf("10.244.%d.%d", i/250, i%250+1)}))
	}
	core, logs := observer.New(zap.InfoLevel)
	tr := NewTracker(zap.NewNop(), func() {})
	src := &KubeSource{Client: fake.NewClientset(objs...), Tracker: tr, Logger: zap.New(core)}
	received := func() bool { return logs.FilterMessage("initial lists received").Len() > 0 }

	tr.mu.Lock()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }() // ends with ctx
	// The informers list 4,000 fake objects in far less than this.
	time.Sleep(500 * time.Millisecond)
	early := received()
	tr.mu.Unlock()
	if early {
		t.Errorf("the initial lists were reported received while the handlers could not record a single object")
	}
	for deadline := time.Now().Add(10 * time.Second); !tr.Synced(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the tracker was not marked synced within 10s")
		}
	}
	ch := tr.Take(true, nil)
	slices := 0
	for _, st := range ch.Services {
		slices += len(st.Slices)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(ch.Services) != n || slices != n {
		t.Errorf("synced with %d services and %d slices, want %d of each", len(ch.Services), slices, n)
	}
}
