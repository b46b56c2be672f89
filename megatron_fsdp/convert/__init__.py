"""Offline checkpoint conversion: no model, no GPU, one step's tensors in memory at a time.

    python -m megatron_fsdp.convert SOURCE OUTPUT --to huggingface [--config config.json]
    torchrun --nproc_per_node 8 -m megatron_fsdp.convert SOURCE OUTPUT --to torch_dist

Our DCP checkpoints, Megatron-LM's ``fsdp_dtensor`` and ``torch_dist``, and Hugging Face model
directories, in the directions docs/checkpointing.md lists ("Offline conversion"). The files:
``sources`` (reading), ``plan`` (a conversion as steps), the tables (``hf_names``,
``megatron_gpt`` with ``gpt_dims``, ``megatron_layouts``, ``megatron_dp_buckets``, ``megatron_plans``), ``writers``,
``runner`` (temporary directory, ranks' shares, commit), ``inert_pickle``, ``errors``, ``api`` and
``__main__``.
"""

from megatron_fsdp.convert.api import convert
from megatron_fsdp.convert.errors import ConversionError

__all__ = ["ConversionError", "convert"]
