package testkube

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
)

// Generated is one service made by Generate.
type Generated struct {
	Name      string
	ClusterIP netip.Addr
	Port      uint16
}

// GenerateSpec says what Generate creates.
type GenerateSpec struct {
	// Services is how many Services to create, named PREFIX-00000 on.
	Services int
	// Endpoints are the addresses of every service's EndpointSlice (all
	// ready, on port TargetPort).
	Endpoints []netip.Addr
	// Namespace; empty means "default".
	Namespace string
	// Prefix of the names; empty means "scale".
	Prefix string
	// Port is the service port; zero means 80. TargetPort is the
	// endpoints' port; zero means 8080.
	Port, TargetPort uint16
	// Workers is how many requests are in flight at once; zero means 16.
	Workers int
}

// Generate creates Services × Endpoints in the API server, as fast as the
// server takes them (the client is not rate-limited), each Service with
// one EndpointSlice, and returns the Services with their allocated
// cluster IPs, in name order.
func Generate(ctx context.Context, cfg *rest.Config, spec GenerateSpec) ([]Generated, error) {
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = -1, 0 // no client-side throttling
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ns := spec.Namespace
	if ns == "" {
		ns = "default"
	}
	prefix := spec.Prefix
	if prefix == "" {
		prefix = "scale"
	}
	port, target := int32(spec.Port), int32(spec.TargetPort)
	if port == 0 {
		port = 80
	}
	if target == 0 {
		target = 8080
	}
	workers := spec.Workers
	if workers <= 0 {
		workers = 16
	}
	eps := make([]discovery.Endpoint, len(spec.Endpoints))
	for i, a := range spec.Endpoints {
		eps[i] = discovery.Endpoint{Addresses: []string{a.String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}}
	}

	out := make([]Generated, spec.Services)
	jobs := make(chan int)
	errs := make(chan error, workers)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() { // exits when jobs is closed or on the first error
			for i := range jobs {
				name := fmt.Sprintf("%s-%05d", prefix, i)
				var svc *v1.Service
				err := retry(ctx, func() error {
					var err error
					svc, err = client.CoreV1().Services(ns).Create(ctx, &v1.Service{
						ObjectMeta: metav1.ObjectMeta{Name: name},
						Spec: v1.ServiceSpec{
							Selector: map[string]string{"app": name},
							Ports:    []v1.ServicePort{{Name: "http", Port: port, TargetPort: intstr.FromInt32(target)}},
						},
					}, metav1.CreateOptions{})
					if apierrors.IsAlreadyExists(err) { // an earlier try got through
						svc, err = client.CoreV1().Services(ns).Get(ctx, name, metav1.GetOptions{})
					}
					return err
				})
				if err == nil {
					err = retry(ctx, func() error {
						_, err := client.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discovery.EndpointSlice{
							ObjectMeta:  metav1.ObjectMeta{Name: name + "-1", Labels: map[string]string{discovery.LabelServiceName: name}},
							AddressType: discovery.AddressTypeIPv4,
							Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To(target), Protocol: ptr.To(v1.ProtocolTCP)}},
							Endpoints:   eps,
						}, metav1.CreateOptions{})
						if apierrors.IsAlreadyExists(err) {
							return nil
						}
						return err
					})
				}
				if err != nil {
					errs <- fmt.Errorf("creating %s/%s: %w", ns, name, err)
					cancel()
					return
				}
				ip, err := netip.ParseAddr(svc.Spec.ClusterIP)
				if err != nil {
					errs <- fmt.Errorf("%s/%s: cluster IP %q: %w", ns, name, svc.Spec.ClusterIP, err)
					cancel()
					return
				}
				out[i] = Generated{Name: name, ClusterIP: ip, Port: uint16(port)}
			}
		})
	}
feed:
	for i := range spec.Services {
		select {
		case jobs <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(jobs)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// retry runs fn until it succeeds, fails with an error that retrying
// cannot fix, or fails 8 times. An apiserver flooded with creates on two
// cores answers some with timeouts, 429s or 5xx, or drops the connection,
// and a burst of new connections can overflow the socket's backlog
// (EAGAIN); those are retried with a growing pause.
func retry(ctx context.Context, fn func() error) error {
	var err error
	pause := 50 * time.Millisecond
	for range 8 {
		if err = fn(); err == nil {
			return nil
		}
		if !(apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) || apierrors.IsTooManyRequests(err) ||
			apierrors.IsInternalError(err) || apierrors.IsServiceUnavailable(err) || utilnet.IsConnectionReset(err) ||
			utilnet.IsProbableEOF(err) || errors.Is(err, syscall.EAGAIN) || errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(pause):
		}
		pause = min(2*pause, 2*time.Second)
	}
	return err
}
