"""Refuses a model chunk that holds a parameter another live wrapper already shards: one
parameter object in two chunks on one rank (pipeline chunks sharing a tied weight, as an
embedding and an output layer would if both virtual stages sat on one rank with the same
object). Each wrapper would point the parameter at its own buffers; the second wrap would see
the first's sharded (empty) storage and fail later with a bare shape error in forward."""

from __future__ import annotations

from torch import nn


def refuse_params_sharded_elsewhere(module: nn.Module) -> None:
    """Raises ``ValueError`` naming the parameters of ``module`` that a live ``MegatronFSDP``
    already shards. Every rank builds the same chunks, so every rank raises, before any
    collective."""
    taken = [
        name
        for name, param in module.named_parameters(remove_duplicate=False)
        if getattr(param, "_megatron_fsdp_owner", None) is not None and param._megatron_fsdp_owner() is not None
    ]
    if taken:
        raise ValueError(
            f"parameters {taken} are already sharded by another MegatronFSDP (a weight shared between model "
            "chunks on one rank): give each chunk its own copy, as megatron-core's "
            "setup_embeddings_and_output_layer does for a tied output layer (marked shared_embedding, its "
            "gradient all-reduced with the embedding's by finalize_model_grads)"
        )
