"""The simulator: per-op cost model, pipeline and serving simulation, validation and fitting against published
results."""
