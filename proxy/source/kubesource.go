package source

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/informers"
	coreinformers "k8s.io/client-go/informers/core/v1"
	discoveryinformers "k8s.io/client-go/informers/discovery/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// KubeSource feeds a Tracker from a Kubernetes API server through client-go
// shared informers, with the label selectors kube-proxy uses: Services and
// EndpointSlices labelled service.kubernetes.io/service-proxy-name belong to
// another proxy, and slices labelled service.kubernetes.io/headless to
// headless services. It also watches this node's own Node object.
type KubeSource struct {
	// Client talks to the API server.
	Client kubernetes.Interface
	// Tracker receives Services and EndpointSlices.
	Tracker *changes.Tracker
	// NodeName is this node's name; its Node object is watched when
	// OnNode is set.
	NodeName string
	// OnNode is called, from the informer's goroutine, whenever this
	// node's Node object is added or changes, and with nil when it is
	// deleted. Nil means the Node is not watched.
	OnNode func(*v1.Node)
	// Resync is the informers' resync period; zero means none (kube-proxy's
	// --config-sync-period defaults to 15m, but uproxy's own full syncs
	// already repair the kernel state).
	Resync time.Duration
	// Logger; nil means none.
	Logger *zap.Logger
}

// Run starts the informers, waits for the initial lists and marks the
// tracker synced, then keeps watching until ctx is done. It returns an
// error only if the caches could not sync before ctx ended. The
// informers' goroutines belong to the factories and stop with ctx.
func (s *KubeSource) Run(ctx context.Context) error {
	if s.Client == nil || s.Tracker == nil {
		return errors.New("KubeSource needs a Client and a Tracker")
	}
	log := s.Logger
	if log == nil {
		log = zap.NewNop()
	}
	noProxyName, err := labels.NewRequirement(service.LabelServiceProxyName, selection.DoesNotExist, nil)
	if err != nil {
		return err
	}
	noHeadless, err := labels.NewRequirement(service.LabelHeadless, selection.DoesNotExist, nil)
	if err != nil {
		return err
	}
	selector := labels.NewSelector().Add(*noProxyName, *noHeadless).String()
	// The caches keep only what uproxy reads of each object (TrimObject):
	// a node agent holds every Service and EndpointSlice of the cluster.
	// For the same reason they have no index: the factory's own informers
	// index every object by namespace, which nothing here looks up.
	tweak := func(o *metav1.ListOptions) { o.LabelSelector = selector }
	factory := informers.NewSharedInformerFactoryWithOptions(s.Client, s.Resync,
		informers.WithTweakListOptions(tweak), informers.WithTransform(TrimObject))

	svcInformer := factory.InformerFor(&v1.Service{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredServiceInformer(c, metav1.NamespaceAll, resync, cache.Indexers{}, tweak)
	})
	svcReg, err := svcInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.Tracker.OnServiceUpsert(obj.(*v1.Service)) },
		UpdateFunc: func(_, obj any) { s.Tracker.OnServiceUpsert(obj.(*v1.Service)) },
		DeleteFunc: func(obj any) {
			if svc, ok := unwrap[*v1.Service](obj); ok {
				s.Tracker.OnServiceDelete(svc)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("watching Services: %w", err)
	}
	sliceInformer := factory.InformerFor(&discovery.EndpointSlice{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return discoveryinformers.NewFilteredEndpointSliceInformer(c, metav1.NamespaceAll, resync, cache.Indexers{}, tweak)
	})
	sliceReg, err := sliceInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.Tracker.OnSliceUpsert(obj.(*discovery.EndpointSlice)) },
		UpdateFunc: func(_, obj any) { s.Tracker.OnSliceUpsert(obj.(*discovery.EndpointSlice)) },
		DeleteFunc: func(obj any) {
			if sl, ok := unwrap[*discovery.EndpointSlice](obj); ok {
				s.Tracker.OnSliceDelete(sl)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("watching EndpointSlices: %w", err)
	}
	// The handlers' registrations, not the informers: an informer has
	// synced once its cache holds the initial list, while its handlers
	// may still be working through their queue of it. Waiting for the
	// informers, a first sync of 10,000 services ran with 1,023 of them
	// still short of endpoints (89,770 of 100,000), as kube-proxy's
	// config package avoids by the same means.
	synced := []cache.InformerSynced{svcReg.HasSynced, sliceReg.HasSynced}

	if s.OnNode != nil {
		nodeFactory := informers.NewSharedInformerFactoryWithOptions(s.Client, s.Resync,
			informers.WithTweakListOptions(func(o *metav1.ListOptions) {
				o.FieldSelector = fields.OneTermEqualSelector("metadata.name", s.NodeName).String()
			}),
			informers.WithTransform(TrimObject))
		nodeInformer := nodeFactory.Core().V1().Nodes().Informer()
		if _, err := nodeInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { s.OnNode(obj.(*v1.Node)) },
			UpdateFunc: func(_, obj any) { s.OnNode(obj.(*v1.Node)) },
			DeleteFunc: func(any) { s.OnNode(nil) },
		}); err != nil {
			return fmt.Errorf("watching Node %s: %w", s.NodeName, err)
		}
		nodeFactory.Start(ctx.Done())
		defer nodeFactory.Shutdown()
	}

	factory.Start(ctx.Done())
	defer factory.Shutdown()
	log.Info("waiting for the initial lists of Services and EndpointSlices")
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return fmt.Errorf("the initial lists did not arrive: %w", context.Cause(ctx))
	}
	// Logged before the tracker hears of it, so that the first sync's
	// "synced" line always comes after this one.
	log.Info("initial lists received")
	s.Tracker.SetServicesSynced()
	s.Tracker.SetSlicesSynced()
	<-ctx.Done()
	return nil
}

// unwrap returns the object of a delete event, which may come wrapped in a
// tombstone when the watch missed the deletion.
func unwrap[T any](obj any) (T, bool) {
	if t, ok := obj.(T); ok {
		return t, true
	}
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		t, ok := tomb.Obj.(T)
		return t, ok
	}
	var zero T
	return zero, false
}
