// Package proxy holds the Proxier, which wires uproxy's parts together: it
// takes the changed Services from the tracker (package changes), opens
// their listeners (package listeners), builds each listener's routing (an
// immutable snapshot of balancers and backends, replaced whole at each sync
// that changes it) and publishes it to the data path, then hands the
// intercepts it wants to a RuleSyncer, which the command wires to the
// redirect package.
//
// Where to look:
//   - proxier.go: Config, the sync and the apply of one service;
//   - snapshot.go: a listener's routing, and the endpoints no Service may
//     use; intercept.go: what the rules must catch;
//   - shared.go: the shared listeners' route tables;
//   - status.go: what the sync stores for `uproxy status` and `uproxy
//     explain`, which package introspect answers, with the metrics;
//   - handover.go, previous.go: hitless upgrades, and serving a previous
//     instance's state before the API server answers.
//
// The model is in package service, the sources in package source.
package proxy
