// Package healthcheck owns uproxy's health checks, byte for byte kube-proxy's:
// the proxy's /healthz and /livez, and the services' health-check node ports.
//
// Two servers are provided, with the wire behaviour of kube-proxy's
// pkg/proxy/healthcheck (k8s.io/kubernetes v1.37.2, files proxy_health.go
// and service_health.go):
//
//   - ProxyHealth tracks whether the proxy's rules are up to date and serves
//     /healthz and /livez on one address, like kube-proxy's
//     --healthz-bind-address server (default 0.0.0.0:10256). Cloud load
//     balancers for externalTrafficPolicy: Cluster services probe /healthz.
//   - ServiceHealth serves, for each service with externalTrafficPolicy:
//     Local, an HTTP server on the service's healthCheckNodePort that
//     answers 200 only while this node has local endpoints for it, so load
//     balancers send external traffic only to such nodes.
//
// Status codes, headers and JSON bodies are byte-for-byte those of
// kube-proxy; the few places where uproxy differs are documented on the
// types (mostly: uproxy is one process for both IP families, it reports
// bind failures as errors instead of Kubernetes events, and it serves
// health before the API server has answered, so it answers 503 until its
// first sync where kube-proxy would not answer at all).
package healthcheck
