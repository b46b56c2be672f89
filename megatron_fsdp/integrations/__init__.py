"""Switches that run other programs on megatron_fsdp: :mod:`megatron_fsdp.integrations.megatron_core`
(Megatron-LM's megatron-core) and :mod:`megatron_fsdp.integrations.hugging_face` (Transformers'
Trainer, Accelerate's checkpoints)."""
