package listeners

import (
	"errors"
	"fmt"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"
)

// Quotas: how many listening sockets one Service, and one namespace, may
// hold (Config.MaxPerService, Config.MaxPerNamespace).
//
// The listener budget (Config.MaxListeners) and the ports (the proxy port
// range, or the share of the kernel's range) are one pool that the sync
// hands out first come, first served; without quotas, one Service of many
// ports, or one namespace of many Services, could take all of it and
// leave every other Service without a listener and without a rule. A
// quota refuses only new listeners: a listener a Service holds is never
// taken back, so that one Service's arrival never breaks another's
// connections, and an adopted socket (a hitless upgrade) is never
// refused, as the budget never refuses one.

// ErrServiceQuota says that a Service holds as many listening sockets as
// Config.MaxPerService allows.
var ErrServiceQuota = errors.New("the Service's listener quota is spent")

// ErrNamespaceQuota says that the Services of a namespace hold as many
// listening sockets as Config.MaxPerNamespace allows.
var ErrNamespaceQuota = errors.New("the namespace's listener quota is spent")

// DefaultServiceQuota returns the bound on one Service's listening
// sockets when Config.MaxPerService is zero, for a budget of that many
// sockets (zero: none, and then no bound).
//
// A 64th of the budget: kube-proxy bounds no Service's ports, and a
// Service that forwards a range of ports one by one (a media relay,
// passive FTP) keeps them all, in both families, within the share of
// the kernel's default local port range; yet dozens of the largest fit
// side by side. In a small budget (a
// narrow --proxy-port-range, a low open-files limit) the floor still
// keeps an ordinary multi-port Service whole, but never gives one
// Service more than half of the budget.
func DefaultServiceQuota(budget int) int {
	if budget <= 0 {
		return 0
	}
	return max(budget/64, min(16, budget/2), 1)
}

// DefaultNamespaceQuota returns the bound on one namespace's listening
// sockets when Config.MaxPerNamespace is zero, for a budget of that many
// sockets (zero: none, and then no bound).
//
// All but an eighth of the budget: whatever one namespace creates, the
// others, kube-system's DNS among them, keep that eighth; and a cluster
// that keeps all its Services in one namespace meets the bound only
// within an eighth of the budget itself, where the shared layout is due
// anyway.
func DefaultNamespaceQuota(budget int) int {
	if budget <= 0 {
		return 0
	}
	return max(budget-budget/8, 1)
}

// quotaOf returns the bound that a Config value sets: itself when
// positive, def(budget) when zero, none (0) when negative.
func quotaOf(v, budget int, def func(int) int) int {
	switch {
	case v > 0:
		return v
	case v < 0:
		return 0
	}
	return def(budget)
}

// holdings counts the listening sockets of the service ports' own
// listeners, by Service and by namespace, for the quotas. The shared
// listeners' sockets are not a Service's, and hosted service ports hold
// none. Owned by the Manager's owner, as the port allocator is.
type holdings struct {
	service   map[types.NamespacedName]int
	namespace map[string]int
}

// add counts d more sockets for k's Service.
func (h *holdings) add(k Key, d int) {
	if k.Name.IsShared() {
		return
	}
	if h.service == nil {
		h.service = map[types.NamespacedName]int{}
		h.namespace = map[string]int{}
	}
	name := k.Name.NamespacedName
	if h.service[name] += d; h.service[name] <= 0 {
		delete(h.service, name)
	}
	if h.namespace[name.Namespace] += d; h.namespace[name.Namespace] <= 0 {
		delete(h.namespace, name.Namespace)
	}
}

// budget returns how many listening sockets the quotas' defaults share
// out: the smaller of Config.MaxListeners and the ports one network's
// listeners may hold (PortRange's size or, without one, the share of the
// kernel's range they may take); zero when neither is bounded.
func (m *Manager) budget() int {
	b := m.ports.portCapacity()
	if l := m.cfg.MaxListeners; l > 0 && (b == 0 || l < b) {
		b = l
	}
	return b
}

// quotas returns the bounds on one Service's and on one namespace's
// listening sockets, from Config (or their defaults for the budget); zero
// means no bound.
func (m *Manager) quotas() (perService, perNamespace int) {
	if !m.quotasSet {
		m.quotasSet = true
		b := m.budget()
		m.perService = quotaOf(m.cfg.MaxPerService, b, DefaultServiceQuota)
		m.perNamespace = quotaOf(m.cfg.MaxPerNamespace, b, DefaultNamespaceQuota)
		m.log.Info("listener quotas (0: no bound)", zap.Int("budget", b),
			zap.Int("perService", m.perService), zap.Int("perNamespace", m.perNamespace))
	}
	return m.perService, m.perNamespace
}

// checkQuotas returns ErrServiceQuota or ErrNamespaceQuota, with the
// counts, when a listener for k would pass its Service's or its
// namespace's quota. Shared listeners are never refused: each stands for
// every Service.
func (m *Manager) checkQuotas(k Key) error {
	if k.Name.IsShared() {
		return nil
	}
	perService, perNamespace := m.quotas()
	name := k.Name.NamespacedName
	if n := m.held.service[name]; perService > 0 && n >= perService {
		return fmt.Errorf("%w: Service %s holds %d listening sockets, its quota (--max-listeners-per-service, here %d)", ErrServiceQuota, name, n, perService)
	}
	if n := m.held.namespace[name.Namespace]; perNamespace > 0 && n >= perNamespace {
		return fmt.Errorf("%w: the Services of namespace %s hold %d listening sockets, their quota (--max-listeners-per-namespace, here %d)", ErrNamespaceQuota, name.Namespace, n, perNamespace)
	}
	return nil
}

// admit returns why a new listener for k may not be opened, or nil: the
// listener budget (Config.MaxListeners), the ports (checkShare), then
// the quotas. The budget and the ports come first: when they are spent,
// raising a quota would not help.
func (m *Manager) admit(k Key) error {
	if err := m.listenerBudget(k); err != nil {
		return err
	}
	if !k.Name.IsShared() {
		if err := m.ports.checkShare(k.Network()); err != nil {
			return err
		}
	}
	return m.checkQuotas(k)
}
