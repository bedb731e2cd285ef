"""Runtime: config loading, launcher, worker entry, training loop, instrumentation."""
