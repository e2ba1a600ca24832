// Package harness is what the bench's parts share: the configuration of
// a run and the flags that set it (Config), the environment every part
// runs in (Env: the binaries, including a baseline uproxy built from an
// older commit, and the progress log), the lab topology the data paths
// and the control plane are measured in (Topo), the real API server and
// kube-proxy (KubeEnv), the CPU profiles (profile.go), the rules the
// harness programs itself (dnat.go) and the processes it starts
// (procs.go).
package harness
