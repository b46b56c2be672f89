"""Flat, dtype-aware buckets: their geometry and pool memory, float8 weights, host offloading, NCCL user buffers, what they show checkpoints and optimizers."""
