package redirect

import "context"

// kernelRead is a read of the family's chains and sets (Syncer.read and
// readSets, in that order) under way on a goroutine of its own, which
// ends before wait returns.
type kernelRead struct {
	done     chan struct{}
	have     state
	saved    []byte
	haveSets setState
	err      error
}

// startRead starts reading the kernel's chains and sets, for a full
// Sync to compare with what it renders meanwhile. The caller holds s.mu
// until wait has returned.
func (s *Syncer) startRead(ctx context.Context) *kernelRead {
	k := &kernelRead{done: make(chan struct{})}
	go func() {
		defer close(k.done)
		if k.have, k.saved, k.err = s.read(ctx); k.err != nil {
			return
		}
		k.haveSets, k.err = s.readSets(ctx)
	}()
	return k
}

// wait returns what the read found, once it has ended. It may be called
// more than once.
func (k *kernelRead) wait() (state, []byte, setState, error) {
	<-k.done
	return k.have, k.saved, k.haveSets, k.err
}
