package balancer

// DefaultMaglevBudget is MaglevBudget's bound when its Bound is zero.
const DefaultMaglevBudget = 64 << 20

// MaglevBudget bounds the memory of the Maglev tables that the source-hash
// balancers of many owners (a proxy's services) hold. A table is sized by
// its backends, and the balancers of one owner share a table whenever
// their backends have the same addresses; still, an owner with thousands
// of balancers over different backends would hold a table for each. So
// the total is bounded: a balancer whose table would pass the bound uses
// rendezvous hashing instead, which needs no table.
//
// The zero value is ready, with the default bound. It is not safe for
// concurrent use: one goroutine (a proxy's sync) rebuilds owners one at a
// time, with Begin, Balancer and Commit. K names an owner.
type MaglevBudget[K comparable] struct {
	// Bound is the most bytes the tables may take together; zero means
	// DefaultMaglevBudget.
	Bound  int64
	owners map[K]map[string]*MaglevTable
	tables int64 // the total of every table in owners
}

func (b *MaglevBudget[K]) bound() int64 {
	if b.Bound <= 0 {
		return DefaultMaglevBudget
	}
	return b.Bound
}

// Bytes returns the memory of the tables the owners hold.
func (b *MaglevBudget[K]) Bytes() int64 { return b.tables }

// MaglevRebuild is one owner's balancers being rebuilt: it reuses the
// tables of the owner's previous ones, and shares new ones between its
// balancers. Begin makes it, Commit ends it.
type MaglevRebuild[K comparable] struct {
	owner      K
	bound      int64
	prev, next map[string]*MaglevTable
	prevBytes  int64
	nextBytes  int64
	others     int64 // the tables of every other owner
	// Fallbacks counts the balancers that use rendezvous hashing because
	// their tables would have passed the bound, and Wanted the bytes those
	// tables would have taken.
	Fallbacks int
	Wanted    int64
}

// Begin starts rebuilding owner's source-hash balancers.
func (b *MaglevBudget[K]) Begin(owner K) *MaglevRebuild[K] {
	r := &MaglevRebuild[K]{owner: owner, bound: b.bound(), prev: b.owners[owner]}
	for _, t := range r.prev {
		r.prevBytes += t.Bytes()
	}
	r.others = b.tables - r.prevBytes
	return r
}

// Balancer returns a source-hash balancer over bs, with a Maglev table
// when one fits the bound and rendezvous hashing otherwise.
func (r *MaglevRebuild[K]) Balancer(bs []*Backend) Balancer {
	if len(bs) == 0 {
		return New(SourceHash, nil)
	}
	key := MaglevKey(bs)
	t := r.next[key]
	if t == nil {
		t = r.prev[key]
		size := MaglevTableBytes(len(bs))
		if t != nil {
			size = t.Bytes()
		}
		// The owner's previous tables are in use until its new balancers
		// replace them; the bound counts what stays after.
		if r.others+r.nextBytes+size > r.bound {
			r.Fallbacks++
			r.Wanted += size
			return NewSourceHash(bs, nil)
		}
		if t == nil {
			t = NewMaglevTable(bs)
		}
		if r.next == nil {
			r.next = map[string]*MaglevTable{}
		}
		r.next[key] = t
		r.nextBytes += size
	}
	return NewSourceHash(bs, t)
}

// Commit records the tables of r's balancers as its owner's, in place of
// the previous ones, once they have replaced them.
func (b *MaglevBudget[K]) Commit(r *MaglevRebuild[K]) {
	b.tables = r.others + r.nextBytes
	if len(r.next) == 0 {
		delete(b.owners, r.owner)
		return
	}
	if b.owners == nil {
		b.owners = map[K]map[string]*MaglevTable{}
	}
	b.owners[r.owner] = r.next
}

// Tables returns how many tables owner's balancers hold.
func (b *MaglevBudget[K]) Tables(owner K) int { return len(b.owners[owner]) }

// Table returns the table owner's balancers over backends share, or nil
// when they have none (rendezvous hashing, or no such balancer).
func (b *MaglevBudget[K]) Table(owner K, backends []*Backend) *MaglevTable {
	return b.owners[owner][MaglevKey(backends)]
}
