"""The optimizer path: the distributed optimizer's step over the main-weight pieces, the host step
when offloaded, and gradient clipping."""
