"""The router process: routing (affinity, prefix, capacity), worker discovery and hashing. Holds no
model: imports no torch, engine, models or kernels (an import-linter contract)."""
