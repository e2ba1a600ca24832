package redirect

// renderMemo keeps, for one Render, the sorted tproxy entries
// (tproxyEntries) of its family and rules: in tproxy mode the gates, the
// OUTPUT marks and each protocol's service chain all derive them, and
// sorting every intercept for each of them made up much of the render of
// a large first sync (BenchmarkRenderTProxy10k). Owned by one Render's
// goroutine.
type renderMemo struct {
	done bool
	es   []tproxyEntry
}

// entries returns tproxyEntries(f, r), sorted once per render. The
// result may be shared by the chains of the render: callers must not
// change it.
func (c chainSpec) entries(f Family, r Rules) []tproxyEntry {
	if c.memo == nil {
		return tproxyEntries(f, r)
	}
	if !c.memo.done {
		c.memo.es, c.memo.done = tproxyEntries(f, r), true
	}
	return c.memo.es
}
