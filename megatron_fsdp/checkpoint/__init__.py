"""Checkpointing: DCP state dicts of the buckets, and save and load with integrity checks."""
