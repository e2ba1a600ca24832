package proxy

import (
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/listeners"
)

// TestListenerWithoutLoopIsRetried checks that a listener that no event
// loop can take (none can start: no descriptor for an epoll instance) is
// closed, reported and retried as one that could not be opened, not left
// listening with nothing accepting on it.
func TestListenerWithoutLoopIsRetried(t *testing.T) {
	be := nameBackend(t, "a")
	core, logs := observer.New(zap.ErrorLevel)
	fail := failingLoops()
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core), StartLoop: fail.start}})
	const name = "default/a:http"
	p.Tracker().Replace([]*v1.Service{svc("a", "10.96.0.10", "http:80")}, slicesFor("a", "http", be))
	waitForRetry(t, logs, name)
	expectRetried(t, p, rules, fail, be, "a")
}

// TestAdoptedListenerWithoutLoopIsRetried checks the same for a listener
// that adopts a socket handed over by a previous process: it is closed
// with its socket, reported and retried during the sync that adopts it,
// not left for the goroutine that starts it after that sync, which
// could only log the failure.
func TestAdoptedListenerWithoutLoopIsRetried(t *testing.T) {
	be := nameBackend(t, "web")
	f, inheritedPort := inheritedTCP4(t)
	core, logs := observer.New(zap.InfoLevel)
	fail := failingLoops()
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core), StartLoop: fail.start}, Inherited: listeners.NewInherited([]listeners.HandoverSocket{{Key: "tcp4 default/web:http", File: f}})})
	const name = "default/web:http"
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	waitForRetry(t, logs, name)
	if logs.FilterMessage("adopted an inherited socket").Len() != 1 {
		t.Fatal("the inherited socket was not adopted")
	}
	if c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", inheritedPort), time.Second); err == nil {
		c.Close()
		t.Errorf("the adopted socket on port %d still queues connections that nothing accepts", inheritedPort)
	}
	expectRetried(t, p, rules, fail, be, "web")
}

// expectRetried checks that service port default/<name>:http (10.96.0.10,
// served by be, whose answer is name), whose listener failed to start
// while fail was set, has no intercept, and that it is retried and
// answers once fail is cleared: with the next sync, which another
// service's arrival starts.
func expectRetried(t *testing.T, p *Proxier, rules *recordingRules, fail *loopFailure, be *backend, name string) {
	t.Helper()
	port := "default/" + name + ":http"
	if rules.has(port) {
		t.Errorf("%s has an intercept to a listener that nothing accepts on", port)
	}
	fail.fail.Store(false)
	p.Tracker().Replace([]*v1.Service{svc(name, "10.96.0.10", "http:80"), svc("b", "10.96.0.11", "http:80")},
		append(slicesFor(name, "http", be), slicesFor("b", "http", be)...))
	if got, err := get(t, rules.port(t, port)); err != nil || got != name {
		t.Errorf("once the loops could start, %s answered %q, %v; want %s", port, got, err, name)
	}
}

// loopFailure makes event loops fail to start, as with no descriptor
// left for an epoll instance (datapath.Config.StartLoop), until fail is
// cleared.
type loopFailure struct{ fail atomic.Bool }

func failingLoops() *loopFailure {
	f := &loopFailure{}
	f.fail.Store(true)
	return f
}

func (f *loopFailure) start() error {
	if f.fail.Load() {
		return unix.EMFILE
	}
	return nil
}

// waitForRetry waits until logs say that the listener of service port
// name could not be opened and will be retried.
func waitForRetry(t *testing.T, logs *observer.ObservedLogs, name string) {
	t.Helper()
	testwait.Until(t, 5*time.Second, "the failure is logged", func() bool {
		for _, e := range logs.FilterMessage("cannot open listener; will retry").All() {
			if e.ContextMap()["servicePort"] == name {
				return true
			}
		}
		return false
	})
}
