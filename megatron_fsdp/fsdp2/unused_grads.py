"""FSDP2's rule for a parameter that got no gradient: its sharded ``.grad`` stays None (FSDP2
reduce-scatters only the parameters with a gradient, unless ``set_reduce_scatter_unused_params(True)``),
so torch's optimizers skip it: no momentum, no weight decay. The engine reduces a bucket as a
whole, zeros standing for such parameters; this puts the None back where FSDP2 has it.

A parameter counts as used once a gradient was delivered to it on this rank since its ``.grad``
was last cleared (``zero_grad`` to None). FSDP2 requires every rank to agree (otherwise its
reduce-scatters mismatch); here a piece that is locally unused but whose reduced gradient is not
all zeros (another rank used it) keeps its gradient, so ranks that disagree never drop a real
contribution.
"""

from __future__ import annotations

import torch

from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access
from megatron_fsdp.engine.step.units import FSDPUnit


class UnusedGrads:
    """One unit's record of which parameters received a gradient since their ``.grad`` was cleared."""

    def __init__(self, unit: FSDPUnit) -> None:
        self.unit = unit
        # FSDP2's set_reduce_scatter_unused_params(True): unused parameters show zeros.
        self.show_zeros = False
        # ids, not the parameters: the hooks live in C++ on the parameters, where a set holding
        # them would make a cycle Python's garbage collector cannot see.
        self._received: set[int] = set()
        self._shown: set[int] = set()
        received = self._received
        for bucket in unit.trainable_buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(lambda p: received.add(id(p)))

    def note_cleared(self) -> None:
        """At a step's first forward, before the cleared gradients are adopted: a face this
        showed a gradient whose ``.grad`` is None now was cleared, and counts as unused again."""
        for bucket in self.unit.trainable_buckets:
            with plain_attribute_access():
                cleared = [id(p) for p, face in zip(bucket.params, bucket.faces) if face.param.grad is None]
            self._received.difference_update(i for i in cleared if i in self._shown)
            self._shown.difference_update(cleared)

    def hide(self) -> None:
        """After a backward showed the gradients: a face of a parameter unused since its
        ``.grad`` was cleared, whose reduced piece is all zeros, shows None, as FSDP2's."""
        for bucket in self.unit.trainable_buckets:
            for index, (param, face) in enumerate(zip(bucket.params, bucket.faces)):
                with plain_attribute_access():
                    grad = face.param.grad
                if grad is None:
                    continue
                key = id(param)
                if key not in self._received and not self.show_zeros and not _any_nonzero(grad):
                    with plain_attribute_access():
                        face.param.grad = None
                        bucket.optim_params[index].grad = None
                    continue
                self._received.add(key)
                self._shown.add(key)


def _any_nonzero(grad: torch.Tensor) -> bool:
    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
    return bool(local.any())
