// Package source feeds a change tracker (changes.Tracker) with Services and
// EndpointSlices: KubeSource from the API server's informers, FileSource
// from a folder of manifests (manifest.go decodes them), and the state file
// that a restarted proxier serves until the initial lists arrive (state.go).
//
// trim.go strips the objects of what uproxy never reads before they are
// stored, which is most of their memory.
package source
