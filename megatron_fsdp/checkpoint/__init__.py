"""Checkpointing: DCP state dicts of the buckets, save and load with integrity checks, and the
rank-0 broadcast into flat pieces."""
