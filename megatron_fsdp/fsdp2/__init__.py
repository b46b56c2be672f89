"""torch FSDP2's API over megatron_fsdp's engine. A program written for FSDP2 changes one line::

    from torch.distributed.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy
    # becomes
    from megatron_fsdp.fsdp2 import fully_shard, FSDPModule, MixedPrecisionPolicy

``fully_shard`` is megatron_fsdp's (api.py); the policy classes, ``FSDPModule`` and
``UnshardHandle`` are torch's own, re-exported: a module sharded here is an instance of torch's
``FSDPModule`` and takes torch's policies. See docs/fsdp2.md.
"""

from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle

from megatron_fsdp.fsdp2.api import fully_shard
from megatron_fsdp.fsdp2.module import MegatronFSDPModule

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MegatronFSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
]
