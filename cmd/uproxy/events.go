package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
)

// eventsController is the reportingController of uproxy's events.
const eventsController = "uproxy"

// eventRecorder reports, as kube-proxy does, through the events.k8s.io
// API: a Starting event on this node's Node, and a Warning on each Service
// or EndpointSlice the tracker rejects (#29). A nil *eventRecorder (no API
// server: the manifests) records nothing.
//
// Its methods never block: the broadcaster queues events and drops them
// when its queue is full, and a goroutine of its own, started by
// newEventRecorder and ended by stop, sends them.
type eventRecorder struct {
	broadcaster events.EventBroadcaster
	recorder    events.EventRecorder
	node        *v1.ObjectReference
}

// newEventRecorder starts recording to client's events.k8s.io API until
// stop is called (or ctx is done).
func newEventRecorder(ctx context.Context, client kubernetes.Interface, nodeName string) *eventRecorder {
	b := events.NewBroadcaster(&events.EventSinkImpl{Interface: client.EventsV1()})
	b.StartRecordingToSink(ctx.Done())
	return &eventRecorder{
		broadcaster: b,
		recorder:    b.NewRecorder(scheme.Scheme, eventsController),
		node:        &v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: nodeName},
	}
}

// starting records kube-proxy's "birth cry": a Normal Starting event on
// the Node, with kube-proxy's action, so that what watches for kube-proxy
// restarts sees uproxy's.
func (r *eventRecorder) starting() {
	if r != nil {
		r.recorder.Eventf(r.node, nil, v1.EventTypeNormal, "Starting", "StartKubeProxy", "")
	}
}

// rejected records a Warning on an object the tracker rejected: it is the
// operator's one place to see, next to the object, that uproxy keeps
// serving its last valid version (or nothing).
func (r *eventRecorder) rejected() func(obj runtime.Object, err error) {
	if r == nil {
		return nil
	}
	return func(obj runtime.Object, err error) {
		r.recorder.Eventf(obj, nil, v1.EventTypeWarning, "Rejected", "Proxy",
			"uproxy cannot proxy this object and keeps its last valid version: %v", err)
	}
}

// stop ends the broadcaster's goroutine, dropping what it has not sent.
func (r *eventRecorder) stop() {
	if r != nil {
		r.broadcaster.Shutdown()
	}
}
