"""From checked arguments to a sharding plan: argument types, the cross-rank check, memory plans, meta-device init, refusals."""
