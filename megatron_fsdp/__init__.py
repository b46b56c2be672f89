"""megatron_fsdp: fully sharded data parallelism for PyTorch on flat, per-unit, dtype-aware buffers."""

from megatron_fsdp import _ops

__all__ = ["_ops"]
__version__ = "0.1.0"
