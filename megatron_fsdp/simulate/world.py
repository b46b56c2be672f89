"""A world of ``W`` ranks as one of them sees it: torch's fake process group and the device mesh
the doors are given, laid out as plan_memory lays ranks out (tensor-parallel fastest, then
context-parallel, dp_shard, dp_outer, and pipeline-parallel slowest)."""

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
    """The mesh as sizes: ``world_size`` ranks, ``pp`` pipeline ranks (slowest; each holds its
    stages' layers), ``dp_outer`` replicas (HSDP), ``cp`` context-parallel ranks (each runs
    1/cp of every sequence; they join dp_shard in the shard group, as ``fully_shard`` over a
    flattened ``dp_cp`` dim), ``tp`` tensor-parallel ranks; dp_shard is what is left. ``ep``:
    expert-parallel ranks (each holds 1/ep of every layer's experts), laid out fastest as
    plan_memory lays them out; the experts are sharded over the ``world_size / ep`` ranks
    holding the same ones."""

    world_size: int
    dp_outer: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        sizes = {"world_size": self.world_size, "dp_outer": self.dp_outer, "tp": self.tp, "ep": self.ep,
                 "pp": self.pp, "cp": self.cp}
        bad = [f"{name}={size}" for name, size in sizes.items() if not isinstance(size, int) or size < 1]
        if bad:
            raise ValueError(f"mesh sizes must be integers >= 1, got {', '.join(bad)}")
        product = self.pp * self.dp_outer * self.cp * self.tp
        if self.world_size % product:
            raise ValueError(
                f"world size {self.world_size} holds no (pp {self.pp}, dp_outer {self.dp_outer}, dp_shard, cp {self.cp}, "
                f"tp {self.tp}) mesh: {self.world_size} is not divisible by {product}; pick sizes whose product divides it"
            )
        if self.ep > 1 and (self.tp > 1 or self.dp_outer > 1 or self.pp > 1 or self.cp > 1 or self.dp_shard % self.ep):
            raise ValueError(
                f"ep {self.ep}: the simulator lays experts out over dp_shard alone (tp, cp, pp and dp_outer 1, and ep "
                f"dividing dp_shard {self.dp_shard})"
            )

    @property
    def dp_shard(self) -> int:
        return self.world_size // (self.pp * self.dp_outer * self.cp * self.tp)

    @property
    def shard_group(self) -> int:
        """The ranks that share each shard: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def shard_dim(self) -> str:
        """The mesh dim the doors shard over: dp_shard, or with cp > 1 (dp_shard, cp) flattened."""
        return "dp_cp" if self.cp > 1 else "dp_shard"

    def pp_rank(self, rank: int) -> int:
        return rank // (self.world_size // self.pp)

    def shape(self) -> tuple[tuple[str, int], ...]:
        """The mesh dims, slowest first; all but dp_shard only when larger than one."""
        dims = [("pp", self.pp), ("dp_outer", self.dp_outer), ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)]
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
    """The device mesh over the fake world, its dims named as :meth:`MeshSizes.shape`, with
    (dp_shard, cp) flattened into ``dp_cp`` when cp > 1."""
    names, shape = zip(*sizes.shape())
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    if sizes.cp > 1:
        mesh["dp_shard", "cp"]._flatten(sizes.shard_dim)
    return mesh


def build_expert_mesh(sizes: MeshSizes) -> DeviceMesh:
    """The expert mesh, (dp_shard, ep) with ep fastest: ``fully_shard``'s ``expt_device_mesh``."""
    return init_device_mesh("cpu", (sizes.world_size // sizes.ep, sizes.ep), mesh_dim_names=("dp_shard", "ep"))
