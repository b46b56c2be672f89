"""A world of ``W`` ranks as one of them sees it: torch's fake process group and the device mesh
the whole-model door is given, laid out as plan_memory lays ranks out (tensor-parallel fastest,
then dp_shard, then dp_outer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import debug as dtensor_debug
from torch.testing._internal.distributed.fake_pg import FakeStore


@dataclass(frozen=True)
class MeshSizes:
    """The mesh as sizes: ``world_size`` ranks, ``dp_outer`` replicas (HSDP), ``tp`` tensor-parallel
    ranks; dp_shard is what is left. ``ep``: expert-parallel ranks (each holds 1/ep of every
    layer's experts), laid out fastest as plan_memory lays them out; the experts are sharded over
    the ``world_size / ep`` ranks holding the same ones."""

    world_size: int
    dp_outer: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        sizes = {"world_size": self.world_size, "dp_outer": self.dp_outer, "tp": self.tp, "ep": self.ep}
        bad = [f"{name}={size}" for name, size in sizes.items() if not isinstance(size, int) or size < 1]
        if bad:
            raise ValueError(f"mesh sizes must be integers >= 1, got {', '.join(bad)}")
        if self.world_size % (self.dp_outer * self.tp):
            raise ValueError(
                f"world size {self.world_size} holds no (dp_outer {self.dp_outer}, dp_shard, tp {self.tp}) mesh: "
                f"{self.world_size} is not divisible by {self.dp_outer * self.tp}; pick sizes whose product divides it"
            )
        if self.ep > 1 and (self.tp > 1 or self.dp_outer > 1 or self.dp_shard % self.ep):
            raise ValueError(
                f"ep {self.ep}: the simulator lays experts out over dp_shard alone (tp 1, dp_outer 1, and ep dividing "
                f"dp_shard {self.dp_shard})"
            )

    @property
    def dp_shard(self) -> int:
        return self.world_size // (self.dp_outer * self.tp)

    def shape(self) -> tuple[tuple[str, int], ...]:
        """The mesh dims, slowest first; dp_outer and tp only when larger than one."""
        dims = [("dp_outer", self.dp_outer), ("dp_shard", self.dp_shard), ("tp", self.tp)]
        return tuple((name, size) for name, size in dims if size > 1 or name == "dp_shard")


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as rank ``rank`` of ``world_size`` on torch's fake backend:
    collectives are recorded by the dispatcher but move nothing. Destroyed on the way out."""
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists in this process: simulate in a process of its own "
            "(the simulated rank is the whole world of this process)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_sharding_cache()


def _forget_sharding_cache() -> None:
    """DTensor caches sharding decisions by their specs, and a spec's mesh compares equal to the
    same-shaped mesh of the next simulated world: without this, the next world's DTensors would
    get this world's mesh, whose groups are gone. torch's own debug helper clears both its
    Python and C++ caches; where it is missing (older torch) only the Python cache exists."""
    clear_both = getattr(dtensor_debug, "_clear_sharding_prop_cache", None)
    if clear_both is not None:
        clear_both()
    else:
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def build_mesh(sizes: MeshSizes) -> DeviceMesh:
    """The device mesh over the fake world, its dims named as :meth:`MeshSizes.shape`."""
    names, shape = zip(*sizes.shape())
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def build_expert_mesh(sizes: MeshSizes) -> DeviceMesh:
    """The expert mesh, (dp_shard, ep) with ep fastest: ``fully_shard``'s ``expt_device_mesh``."""
    return init_device_mesh("cpu", (sizes.world_size // sizes.ep, sizes.ep), mesh_dim_names=("dp_shard", "ep"))
