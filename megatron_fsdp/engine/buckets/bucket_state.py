"""The states a bucket moves through in a step, in one place, with the transitions the schedule
(engine/step/schedule.py) makes. Two independent machines, one for each of the bucket's two
lives: :class:`WeightsState` for its weights (bucket_weights.py), :class:`GradsState` for its
gradients (bucket_grads.py).

- Weights (strategies that shard them): ``SHARDED`` -> ``gather`` (the pooled bucket is filled
  and the all-gather launched) -> ``GATHERED`` -> ``release`` (back to the pool) -> ``SHARDED``.
  A root unit's bucket is released as soon as its gradients are in, and again, as a no-op, with
  its unit. Where weights are not sharded the bucket stays ``SHARDED``: its full weights are its
  own, never pooled.
- Gradients, each backward: a parameter's gradient arrives in its ``.grad`` (``note_grad``:
  held), is taken into the un-reduced buffer (``forget_held``); once every parameter delivered
  one the bucket is complete and its reduction may start; ``end_backward`` forgets who delivered.
- Reduced gradients: a finished reduction leaves the dp_outer average ``DUE`` (HSDP); its launch
  puts it ``IN_FLIGHT`` (the collective writes the gradients: nothing reads or changes them until
  it is waited for) and its wait ``AVERAGED``. Every change of them leaves what the optimizer's
  pieces and the faces show stale until ``grads_shown``. The two are independent: gradients may be
  shown before the outer average (upstream's ``attach_grad_to_optimizer_state`` may come first),
  which then changes them.
"""

from __future__ import annotations

import enum


class WeightState(enum.Enum):
    SHARDED = "sharded"  # no pooled memory: this rank's shard only (or unsharded weights of its own)
    GATHERED = "gathered"  # the pooled bucket holds the gathered weights, or a gather in flight


class WeightsState:
    """A bucket's weights; one method per transition, a wrong one raises."""

    def __init__(self, name: str) -> None:
        self.name = name  # for errors: which bucket
        self.current = WeightState.SHARDED

    @property
    def gathered(self) -> bool:
        return self.current is WeightState.GATHERED

    def gather(self) -> None:
        if self.gathered:
            # A second fill would leak the first gather's pool memory.
            raise RuntimeError(f"bucket {self.name}: gathered again without a reshard in between")
        self.current = WeightState.GATHERED

    def release(self) -> bool:
        """Back to SHARDED; False when it was already (nothing to give back)."""
        was_gathered = self.gathered
        self.current = WeightState.SHARDED
        return was_gathered


class OuterAverage(enum.Enum):
    AVERAGED = "averaged"  # nothing due: averaged over dp_outer, no outer group, or released
    DUE = "due"  # reduced over the shard group since the last average
    IN_FLIGHT = "in flight"  # the average launched, not yet waited for


class GradsState:
    """A bucket's gradients; one method per transition."""

    def __init__(self, name: str, num_params: int) -> None:
        self.name = name  # for errors: which bucket
        # This backward: which parameters delivered a gradient, and which of those still hold it
        # in their .grad (in arrival order), not yet taken into the un-reduced buffer.
        self._received = [False] * num_params
        self._received_count = 0
        self.held: list[int] = []
        self._holding = [False] * num_params
        # The average over dp_outer (HSDP) of what the shard group reduced.
        self.outer = OuterAverage.AVERAGED
        # Whether the optimizer's pieces and the faces show the current reduced gradients, and
        # how many times they changed (an optimizer's zero_grad counts what it cleared since).
        self.grads_shown = True
        self.grad_changes = 0

    # -- gradients of one backward ------------------------------------------------------------

    def note_grad(self, index: int) -> bool:
        """Parameter ``index``'s ``.grad`` holds a new gradient; True once every parameter has
        delivered one in this backward."""
        if not self._holding[index]:
            self._holding[index] = True
            self.held.append(index)
        if self._received[index]:
            return False
        self._received[index] = True
        self._received_count += 1
        return self._received_count == len(self._received)

    def forget_held(self) -> None:
        """The held gradients left the parameters' ``.grad``: taken into the un-reduced buffer,
        or dropped after a backward that raised."""
        for index in self.held:
            self._holding[index] = False
        self.held = []

    def end_backward(self) -> None:
        self._received = [False] * len(self._received)
        self._received_count = 0

    # -- reduced gradients --------------------------------------------------------------------

    @property
    def outer_sync_due(self) -> bool:
        return self.outer is OuterAverage.DUE

    @property
    def outer_in_flight(self) -> bool:
        return self.outer is OuterAverage.IN_FLIGHT

    def reduction_finished(self, has_outer: bool) -> None:
        # An average in flight writes the main gradient this reduction has just added to.
        self._require_outer_not_in_flight("a reduction finished")
        if has_outer:
            self.outer = OuterAverage.DUE

    def outer_launched(self) -> None:
        if self.outer is not OuterAverage.DUE:
            raise RuntimeError(f"bucket {self.name}: a dp_outer average was launched while {self.outer.value}")
        self.outer = OuterAverage.IN_FLIGHT

    def outer_synced(self) -> None:
        if self.outer is not OuterAverage.IN_FLIGHT:
            raise RuntimeError(f"bucket {self.name}: a dp_outer average was waited for while {self.outer.value}")
        self.outer = OuterAverage.AVERAGED

    def outer_dropped(self) -> None:
        """The reduced gradients were released: nothing is left to average."""
        self._require_outer_not_in_flight("the gradients were released")
        self.outer = OuterAverage.AVERAGED

    def _require_outer_not_in_flight(self, what: str) -> None:
        if self.outer is OuterAverage.IN_FLIGHT:
            raise RuntimeError(f"bucket {self.name}: {what} while its dp_outer average was in flight")

    def grads_changing(self) -> None:
        self.grads_shown = False
        self.grad_changes += 1

    def grads_now_shown(self) -> None:
        self.grads_shown = True
