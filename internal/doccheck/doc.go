// Package doccheck has no code of its own: its tests check the project's
// words. Comments state no measured figure and cite no issue; package
// documentation stays a short map; every relative link of the Markdown
// files resolves, and every test and metric they name exists; tests wait
// on conditions and sleep rarely. cmd/uproxy's docflags test checks the
// flags the docs cite.
package doccheck
