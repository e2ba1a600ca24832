// Package service is uproxy's model of a Service: the validated ports it
// proxies (Port, named by PortName) and their endpoints (Endpoint,
// EndpointSets), converted from Services and EndpointSlices the way
// kube-proxy reads them.
//
// Where to look:
//   - model.go: the types, and the annotations and labels uproxy reads;
//   - convert.go: validation (ValidateService, ValidateSlice), Ports and
//     PortEndpoints, which resolve target ports and refuse endpoints no
//     Service may send to;
//   - topology.go: CategorizeEndpoints, traffic policies and topology hints.
//
// It holds no state: the change tracker (package changes) keeps the objects,
// and the proxier turns each Port into listeners.
package service
