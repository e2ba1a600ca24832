package changes

import (
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/uproxy/uproxy/proxy/service"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
)

// Tracker records Service and EndpointSlice changes from any source and
// hands them to the Proxier's sync. Its event methods only record: they
// validate, store and mark the affected service dirty, then call Notify.
// It is safe for concurrent use.
//
// An invalid object is rejected on its own: it is logged, and the last
// valid version of that object (if any) stays in effect, so a bad edit
// never disturbs the service's traffic nor any other service.
type Tracker struct {
	// Notify is called, without the lock held, after a change is recorded.
	// It must not block (the sync runner's Run is the usual value).
	Notify func()
	// Logger receives rejections; nil means no logging.
	Logger *zap.Logger
	// OnReject, if set, is called with each rejected object and the
	// reason, from the caller of the event method, without the lock held;
	// it must not block. Set it before the first event.
	OnReject func(obj runtime.Object, err error)

	mu       sync.Mutex
	services map[types.NamespacedName]*v1.Service
	slices   map[types.NamespacedName]*discovery.EndpointSlice
	// slicesBySvc lists each service's slices. A service has few, most
	// often one: a slice of names costs a fraction of a map per service.
	slicesBySvc                  map[types.NamespacedName][]types.NamespacedName
	dirty                        map[types.NamespacedName]bool
	servicesSynced, slicesSynced bool
	serviceChanges, sliceChanges int
	// triggers holds, per service, the last-change-trigger-time of each
	// slice change recorded since the last Take (network programming
	// latency); start is when the tracker was created: older trigger
	// times belong to changes made before uproxy ran, as kube-proxy
	// reasons.
	triggers map[types.NamespacedName][]TriggerTime
	start    time.Time
	// seededSvc and seededSlice are the objects that seed recorded from
	// a previous instance's state and no source has reported since: the
	// initial list of their kind deletes those left (a source never
	// reports the deletion of an object it never knew).
	seededSvc, seededSlice map[types.NamespacedName]bool
	seedPending            bool // seeded objects that no sync has applied
}

// TriggerTime is when an endpoint change was triggered (its slice's
// last-change-trigger-time), and the family of the slice's addresses:
// kube-proxy observes each family's network programming latency apart.
type TriggerTime struct {
	At     time.Time
	Family v1.IPFamily
}

// NewTracker returns an empty tracker.
func NewTracker(log *zap.Logger, notify func()) *Tracker {
	return &Tracker{
		Notify:      notify,
		Logger:      log,
		services:    map[types.NamespacedName]*v1.Service{},
		slices:      map[types.NamespacedName]*discovery.EndpointSlice{},
		slicesBySvc: map[types.NamespacedName][]types.NamespacedName{},
		dirty:       map[types.NamespacedName]bool{},
		triggers:    map[types.NamespacedName][]TriggerTime{},
		start:       time.Now(),
		seededSvc:   map[types.NamespacedName]bool{},
		seededSlice: map[types.NamespacedName]bool{},
	}
}

// Seed records the Services and EndpointSlices of a previous instance's
// last sync, before any source has listed: they are served until the
// initial lists arrive, which replace them (see Proxier.ServePrevious).
// It does not notify.
func (t *Tracker) Seed(services []*v1.Service, slices []*discovery.EndpointSlice) {
	for _, s := range services {
		if t.upsertService(s) {
			t.mu.Lock()
			t.seededSvc[service.NameOf(s.Namespace, s.Name)] = true
			t.seedPending = true
			t.mu.Unlock()
		}
	}
	for _, s := range slices {
		if t.upsertSlice(s) {
			t.mu.Lock()
			t.seededSlice[service.NameOf(s.Namespace, s.Name)] = true
			t.seedPending = true
			t.mu.Unlock()
		}
	}
}

// TakeSeed reports whether seeded objects await their first apply, and
// clears that.
func (t *Tracker) TakeSeed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	pending := t.seedPending
	t.seedPending = false
	return pending
}

// Objects returns every tracked Service and EndpointSlice, sorted by
// name. They must not be modified.
func (t *Tracker) Objects() ([]*v1.Service, []*discovery.EndpointSlice) {
	t.mu.Lock()
	services := slices.Collect(maps.Values(t.services))
	eps := slices.Collect(maps.Values(t.slices))
	t.mu.Unlock()
	slices.SortFunc(services, func(a, b *v1.Service) int { return compareNames(a.ObjectMeta, b.ObjectMeta) })
	slices.SortFunc(eps, func(a, b *discovery.EndpointSlice) int { return compareNames(a.ObjectMeta, b.ObjectMeta) })
	return services, eps
}

func compareNames(a, b metav1.ObjectMeta) int {
	if c := strings.Compare(a.Namespace, b.Namespace); c != 0 {
		return c
	}
	return strings.Compare(a.Name, b.Name)
}

// notify tells the consumer that a sync has something to apply: only
// once both initial lists have arrived (setSynced notifies then). Until
// that, the changes only accumulate: 10,000 objects arriving in the
// initial lists would otherwise each ask for a sync that can do nothing.
func (t *Tracker) notify() {
	if t.Notify != nil && t.Synced() {
		t.Notify()
	}
}

func (t *Tracker) reject(kind string, key types.NamespacedName, obj runtime.Object, err error) {
	if t.Logger != nil {
		t.Logger.Error("rejected invalid object; keeping its last valid version",
			zap.String("kind", kind), zap.Stringer("object", key), zap.Error(err))
	}
	if t.OnReject != nil {
		t.OnReject(obj, err)
	}
}

// OnServiceUpsert records that svc was added or updated.
func (t *Tracker) OnServiceUpsert(svc *v1.Service) {
	if t.upsertService(svc) {
		t.notify()
	}
}

func (t *Tracker) upsertService(svc *v1.Service) bool {
	key := service.NameOf(svc.Namespace, svc.Name)
	if err := service.ValidateService(svc); err != nil {
		t.reject("Service", key, svc, err)
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.seededSvc, key) // a source knows it
	if old := t.services[key]; old != nil && sameServiceInputs(old, svc) {
		return false
	}
	t.services[key] = svc
	t.dirty[key] = true
	t.serviceChanges++
	return true
}

// sameServiceInputs reports whether a and b agree on every field uproxy
// reads from a Service: its spec, its status (the cloud controller assigns
// status.loadBalancer.ingress with a status-only update, after
// creation), its annotations and its labels.
func sameServiceInputs(a, b *v1.Service) bool {
	return equality.Semantic.DeepEqual(a.Spec, b.Spec) && equality.Semantic.DeepEqual(a.Status, b.Status) &&
		maps.Equal(a.Annotations, b.Annotations) && maps.Equal(a.Labels, b.Labels)
}

// OnServiceDelete records that svc was deleted.
func (t *Tracker) OnServiceDelete(svc *v1.Service) {
	if t.deleteService(service.NameOf(svc.Namespace, svc.Name)) {
		t.notify()
	}
}

func (t *Tracker) deleteService(key types.NamespacedName) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.deleteServiceLocked(key)
}

func (t *Tracker) deleteServiceLocked(key types.NamespacedName) bool {
	delete(t.seededSvc, key)
	if _, ok := t.services[key]; !ok {
		return false
	}
	delete(t.services, key)
	t.dirty[key] = true
	t.serviceChanges++
	return true
}

// OnSliceUpsert records that s was added or updated.
func (t *Tracker) OnSliceUpsert(s *discovery.EndpointSlice) {
	if t.upsertSlice(s) {
		t.notify()
	}
}

func (t *Tracker) upsertSlice(s *discovery.EndpointSlice) bool {
	key := service.NameOf(s.Namespace, s.Name)
	if err := service.ValidateSlice(s); err != nil {
		t.reject("EndpointSlice", key, s, err)
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.seededSlice, key) // a source knows it
	old := t.slices[key]
	if old != nil && old.AddressType == s.AddressType && equality.Semantic.DeepEqual(old.Endpoints, s.Endpoints) &&
		equality.Semantic.DeepEqual(old.Ports, s.Ports) && maps.Equal(old.Labels, s.Labels) {
		return false
	}
	if old != nil {
		t.unindex(key, old)
	}
	t.slices[key] = s
	if svc := service.SliceService(s); svc.Name != "" {
		if !slices.Contains(t.slicesBySvc[svc], key) {
			t.slicesBySvc[svc] = append(t.slicesBySvc[svc], key)
		}
		t.dirty[svc] = true
		if tt := service.SliceTriggerTime(s); !tt.IsZero() && tt.After(t.start) {
			t.triggers[svc] = append(t.triggers[svc], TriggerTime{At: tt, Family: service.SliceFamily(s)})
		}
	}
	t.sliceChanges++
	return true
}

// OnSliceDelete records that s was deleted.
func (t *Tracker) OnSliceDelete(s *discovery.EndpointSlice) {
	if t.deleteSlice(service.NameOf(s.Namespace, s.Name)) {
		t.notify()
	}
}

func (t *Tracker) deleteSlice(key types.NamespacedName) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.deleteSliceLocked(key)
}

func (t *Tracker) deleteSliceLocked(key types.NamespacedName) bool {
	delete(t.seededSlice, key)
	old, ok := t.slices[key]
	if !ok {
		return false
	}
	t.unindex(key, old)
	delete(t.slices, key)
	t.sliceChanges++
	return true
}

// unindex removes the slice key from its service's index and marks the
// service dirty. Called with t.mu held.
func (t *Tracker) unindex(key types.NamespacedName, s *discovery.EndpointSlice) {
	svc := service.SliceService(s)
	if svc.Name == "" {
		return
	}
	if keys := slices.DeleteFunc(t.slicesBySvc[svc], func(k types.NamespacedName) bool { return k == key }); len(keys) > 0 {
		t.slicesBySvc[svc] = keys
	} else {
		delete(t.slicesBySvc, svc)
	}
	t.dirty[svc] = true
}

// Replace makes the tracked objects exactly services and slices, recording
// only what differs. It is how a source that always knows the whole state
// (the manifest files) reports it. It also marks both initial lists as
// synced.
func (t *Tracker) Replace(services []*v1.Service, slices []*discovery.EndpointSlice) {
	changed := false
	wantSvc := map[types.NamespacedName]bool{}
	for _, s := range services {
		wantSvc[service.NameOf(s.Namespace, s.Name)] = true
		changed = t.upsertService(s) || changed
	}
	wantSlice := map[types.NamespacedName]bool{}
	for _, s := range slices {
		wantSlice[service.NameOf(s.Namespace, s.Name)] = true
		changed = t.upsertSlice(s) || changed
	}
	t.mu.Lock()
	var goneSvc, goneSlice []types.NamespacedName
	for k := range t.services {
		if !wantSvc[k] {
			goneSvc = append(goneSvc, k)
		}
	}
	for k := range t.slices {
		if !wantSlice[k] {
			goneSlice = append(goneSlice, k)
		}
	}
	first := !t.servicesSynced || !t.slicesSynced
	t.servicesSynced, t.slicesSynced = true, true
	t.mu.Unlock()
	for _, k := range goneSvc {
		changed = t.deleteService(k) || changed
	}
	for _, k := range goneSlice {
		changed = t.deleteSlice(k) || changed
	}
	if changed || first {
		t.notify()
	}
}

// SetServicesSynced records that the initial list of Services has
// arrived: seeded Services that it did not hold are deleted.
func (t *Tracker) SetServicesSynced() {
	t.setSynced(&t.servicesSynced, t.seededSvc, t.deleteServiceLocked)
}

// SetSlicesSynced records that the initial list of EndpointSlices has
// arrived: seeded EndpointSlices that it did not hold are deleted.
func (t *Tracker) SetSlicesSynced() {
	t.setSynced(&t.slicesSynced, t.seededSlice, t.deleteSliceLocked)
}

// setSynced sets flag and deletes, with delLocked, the seeded objects
// of the list that arrived.
func (t *Tracker) setSynced(flag *bool, seeded map[types.NamespacedName]bool, delLocked func(types.NamespacedName) bool) {
	t.mu.Lock()
	for k := range seeded {
		delLocked(k) // removes k from seeded
	}
	*flag = true
	t.mu.Unlock()
	t.notify()
}

// Synced reports whether both initial lists have arrived. The Proxier
// never syncs before that, so it never programs a partial state.
func (t *Tracker) Synced() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.servicesSynced && t.slicesSynced
}

// ServiceState is one service's objects as of a Take.
type ServiceState struct {
	Name    types.NamespacedName
	Service *v1.Service // nil when the service does not exist
	Slices  []*discovery.EndpointSlice
}

// Changes is what a Take returns.
type Changes struct {
	// Services lists the state of every service that changed (all of them
	// on a full take), sorted by name.
	Services []ServiceState
	// ServiceChanges and SliceChanges count the recorded events since the
	// last Take.
	ServiceChanges, SliceChanges int
	// TriggerTimes are the last-change-trigger-time annotations of the
	// slice changes recorded since the last Take, per service: when each
	// change was triggered, for the network programming latency.
	TriggerTimes map[types.NamespacedName][]TriggerTime
}

// Take returns the services that changed since the last Take and clears
// the record. With all set it returns every known service, plus those
// named in also (services the caller still programs, so deletions missed
// by a failed sync are seen). The returned objects must not be modified.
func (t *Tracker) Take(all bool, also []types.NamespacedName) Changes {
	t.mu.Lock()
	defer t.mu.Unlock()
	names := t.dirty
	t.dirty = map[types.NamespacedName]bool{}
	if all {
		for k := range t.services {
			names[k] = true
		}
		for _, k := range also {
			names[k] = true
		}
	}
	c := Changes{ServiceChanges: t.serviceChanges, SliceChanges: t.sliceChanges}
	t.serviceChanges, t.sliceChanges = 0, 0
	if len(t.triggers) > 0 {
		c.TriggerTimes = t.triggers
		t.triggers = map[types.NamespacedName][]TriggerTime{}
	}
	keys := slices.SortedFunc(maps.Keys(names), func(a, b types.NamespacedName) int {
		if a.Namespace != b.Namespace {
			if a.Namespace < b.Namespace {
				return -1
			}
			return 1
		}
		if a.Name < b.Name {
			return -1
		} else if a.Name > b.Name {
			return 1
		}
		return 0
	})
	for _, k := range keys {
		st := ServiceState{Name: k, Service: t.services[k]}
		for _, sk := range t.slicesBySvc[k] {
			st.Slices = append(st.Slices, t.slices[sk])
		}
		c.Services = append(c.Services, st)
	}
	return c
}

// Pending returns how many Service and EndpointSlice changes were recorded
// since the last Take: kube-proxy's *_changes_pending.
func (t *Tracker) Pending() (services, slices int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.serviceChanges, t.sliceChanges
}

// Requeue marks names dirty again, for services whose sync failed.
func (t *Tracker) Requeue(names ...types.NamespacedName) {
	t.mu.Lock()
	for _, n := range names {
		t.dirty[n] = true
	}
	t.mu.Unlock()
}
