package paths

import (
	"context"

	"github.com/uproxy/uproxy/bench/internal/harness"
)

func setupKubeProxy(mode string) func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv) (*harness.PathRun, error) {
	return func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv) (*harness.PathRun, error) {
		if err := harness.KubeProxyNA(k, mode); err != nil {
			return nil, err
		}
		if err := k.EnsureBenchService(ctx, t); err != nil {
			return nil, err
		}
		if err := k.Connect(ctx, t.Lab); err != nil {
			return nil, err
		}
		p, err := t.Lab.Start(t.Lab.Node, "kube-proxy", harness.KubeProxyArgs(k.KubeProxy, k.CP.Kubeconfig, mode)...)
		if err != nil {
			return nil, err
		}
		r := vipRun()
		r.Proc, r.Comm, r.Binary = p, "kube-proxy", k.KubeProxy
		return r, nil
	}
}
