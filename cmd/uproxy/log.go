package main

import (
	"fmt"

	"github.com/go-logr/zapr"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"k8s.io/klog/v2"
)

// logFlags are the logging flags every command shares.
type logFlags struct {
	format    string
	verbosity int
}

func (f *logFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.format, "log-format", "console", "Log format: console or json.")
	fs.IntVarP(&f.verbosity, "v", "v", 0, "Log verbosity: 0 logs changes and errors, 1 adds per-sync details, 2 and up add debugging detail.")
}

// logger builds the process logger and routes client-go's klog output into
// it, so every line has one format.
func (f *logFlags) logger() (*zap.Logger, error) {
	var cfg zap.Config
	switch f.format {
	case "console":
		cfg = zap.NewDevelopmentConfig()
		cfg.Development = false
		cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	case "json":
		cfg = zap.NewProductionConfig()
		cfg.Sampling = nil // per-connection logs are sampled where they are made
	default:
		return nil, fmt.Errorf("--log-format: %q is not console or json", f.format)
	}
	if f.verbosity < 0 {
		return nil, fmt.Errorf("-v: %d is negative", f.verbosity)
	}
	// zap's levels below Debug are -2, -3, …: -v N enables down to -N.
	cfg.Level = zap.NewAtomicLevelAt(zapcore.Level(-min(f.verbosity, 127)))
	cfg.DisableStacktrace = true
	log, err := cfg.Build()
	if err != nil {
		return nil, err
	}
	klog.SetLogger(zapr.NewLogger(log.Named("klog")))
	return log, nil
}
