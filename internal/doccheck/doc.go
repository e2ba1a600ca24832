// Package doccheck has no code of its own: its test checks that every relative
// link in README.md and docs/*.md names a file or folder of the repository.
package doccheck
