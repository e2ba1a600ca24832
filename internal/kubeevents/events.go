// Package kubeevents owns the Events uproxy reports to the API server, as
// kube-proxy does: Starting on this node's Node, a Warning on each rejected object.
//
// The events go through the events.k8s.io API, with uproxy as their
// reporting controller; without an API server (the manifests) there is no
// Recorder, and its nil value records nothing.
package kubeevents

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
)

// Controller is the reportingController of uproxy's events.
const Controller = "uproxy"

// Recorder reports a Starting event on this node's Node, and a Warning on
// each Service or EndpointSlice the tracker rejects. A nil
// *Recorder records nothing.
//
// Its methods never block and are safe for concurrent use: the
// broadcaster queues events and drops them when its queue is full, and a
// goroutine of its own, started by New and ended by Stop (or when New's
// ctx is done), sends them.
type Recorder struct {
	broadcaster events.EventBroadcaster
	recorder    events.EventRecorder
	node        *v1.ObjectReference
}

// New starts recording to client's events.k8s.io API, for the Node
// nodeName, until Stop is called or ctx is done.
func New(ctx context.Context, client kubernetes.Interface, nodeName string) *Recorder {
	b := events.NewBroadcaster(&events.EventSinkImpl{Interface: client.EventsV1()})
	b.StartRecordingToSink(ctx.Done())
	return &Recorder{
		broadcaster: b,
		recorder:    b.NewRecorder(scheme.Scheme, Controller),
		node:        &v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: nodeName},
	}
}

// Starting records kube-proxy's "birth cry": a Normal Starting event on
// the Node, with kube-proxy's action, so that what watches for kube-proxy
// restarts sees uproxy's.
func (r *Recorder) Starting() {
	if r != nil {
		r.recorder.Eventf(r.node, nil, v1.EventTypeNormal, "Starting", "StartKubeProxy", "")
	}
}

// Rejected returns the tracker's OnReject hook, which records a Warning on
// an object the tracker rejected: it is the operator's one place to see,
// next to the object, that uproxy keeps serving its last valid version
// (or nothing). A nil r returns nil, which records nothing.
func (r *Recorder) Rejected() func(obj runtime.Object, err error) {
	if r == nil {
		return nil
	}
	return func(obj runtime.Object, err error) {
		r.recorder.Eventf(obj, nil, v1.EventTypeWarning, "Rejected", "Proxy",
			"uproxy cannot proxy this object and keeps its last valid version: %v", err)
	}
}

// Refused returns the proxier's OnRefuse hook, which records a Warning
// on a Service part of which uproxy refuses (an address another Service
// owns) while serving the rest. A nil r returns nil.
func (r *Recorder) Refused() func(obj runtime.Object, err error) {
	if r == nil {
		return nil
	}
	return func(obj runtime.Object, err error) {
		r.recorder.Eventf(obj, nil, v1.EventTypeWarning, "Rejected", "Proxy",
			"uproxy refuses part of this object and serves the rest: %v", err)
	}
}

// Stop ends the broadcaster's goroutine, dropping what it has not sent.
func (r *Recorder) Stop() {
	if r != nil {
		r.broadcaster.Shutdown()
	}
}
