"""A training step: units, the schedule of gathers and reductions, the hooks that drive it."""
