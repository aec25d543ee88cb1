"""The worker processes: the engine thread, the single-process backend, the disaggregation worker and
the KV transport with its limits."""
