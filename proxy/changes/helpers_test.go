package changes

import "github.com/uproxy/uproxy/internal/testobj"

// Short names for the test objects, which most tests build.
var (
	svc   = testobj.Service
	slice = testobj.Slice
)

type ep = testobj.Endpoint
