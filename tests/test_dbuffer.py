"""``megatron_fsdp.experimental.DBuffer`` (upstream's v2 flat distributed buffer), gloo world 2, in
one run of both ranks: every value is compared exactly (the collectives add at most two addends
in one order, and fp32 sums of two values are the same in any process) with what one process
computes from the whole tensors: the all-gather gives the tensors back, the reduce-scatter and
all-reduce give their sum (or mean), the per-tensor DTensors' ``full_tensor()`` gives the tensors
although a rank's rows are not ``torch.chunk``'s, and DCP round trips between world 2 and
world 1. What DBuffer refuses raises the same error on both ranks before any collective."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from _dist import run_distributed

# Row lengths 4, 1, 6, 6 and 6: every tensor starts at a multiple of 12, ranks' ranges cut
# between rows, and the empty tensor and the 1-D one still have a place.
SHAPES = [(3, 4), (5,), (2, 2, 3), (0, 6), (7, 6)]


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _equal_all(buffer, tensors) -> bool:
    return all(torch.equal(buffer.get_local_tensor(i), t) for i, t in enumerate(tensors))


def _full_tensors_equal(faces, tensors) -> bool:
    """Every face's ``full_tensor()`` (a collective: all of them on every rank, whatever the
    values) equals its tensor."""
    full = [face.full_tensor() for face in faces]
    return all(torch.equal(f, t) for f, t in zip(full, tensors, strict=True))


def _faces(buffer) -> list:
    return [buffer.get_dtensor(i) for i in range(len(SHAPES))]


def _state(buffer) -> dict:
    """The buffer's DTensors as a state dict for DCP."""
    return {f"t{i}": face for i, face in enumerate(_faces(buffer))}


def _refusal(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type and message are what the test compares
        return type(error).__name__, str(error)
    return None


def _dbuffer_run(rank: int, world: int, directory: str) -> dict:
    from megatron_fsdp.experimental import DBuffer, Flat, Partial, Replicate

    found: dict = {}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tensors = _tensors(0)

    # Flat: each rank's rows, views into its local buffer; all-gather and the DTensors give the tensors.
    flat = DBuffer.distribute_tensors(tensors, mesh, [Flat()])
    found["local rows"] = [flat.get_local_tensor(i).clone() for i in range(len(SHAPES))]
    found["local views"] = all(
        flat.get_local_tensor(i).numel() == 0
        or flat.get_local_tensor(i).untyped_storage().data_ptr() == flat.local_buffer.untyped_storage().data_ptr()
        for i in range(len(SHAPES))
    )
    replicated = flat.redistribute([Replicate()])
    found["all-gather gives the tensors"] = _equal_all(replicated, tensors)
    faces = _faces(flat)
    found["face placements"] = {tuple(f.placements) for f in faces} == {(Shard(0),)}
    found["full_tensor gives the tensors"] = _full_tensors_equal(faces, tensors)
    found["replicated full_tensor"] = _full_tensors_equal(_faces(replicated), tensors)
    gathered_into = DBuffer(mesh, [Replicate()], SHAPES, torch.float32, "cpu")
    target = gathered_into.local_buffer.data_ptr()
    found["all-gather into out"] = flat.allgather("dp", out=gathered_into) is gathered_into and (
        gathered_into.local_buffer.data_ptr() == target and _equal_all(gathered_into, tensors)
    )

    # Partial: rank r holds (r + 1) * t + r; the sum and the mean as one process computes them.
    addends = [[(r + 1) * t + r for t in tensors] for r in range(world)]
    sums = [sum(parts[i] for parts in addends) for i in range(len(SHAPES))]
    partial = DBuffer(mesh, [Partial()], SHAPES, torch.float32, "cpu")
    for i, addend in enumerate(addends[rank]):
        partial.get_local_tensor(i).copy_(addend)
    found["partial full_tensor is the sum"] = _full_tensors_equal(_faces(partial), sums)
    scattered = partial.redistribute([Flat()])
    found["reduce-scatter gives the sum"] = _equal_all(scattered.redistribute([Replicate()]), sums)
    found["all-reduce gives the sum"] = _equal_all(partial.redistribute([Replicate()]), sums)
    average = DBuffer.from_local(partial.local_buffer, mesh, [Partial(dist.ReduceOp.AVG)], SHAPES)
    found["reduce-scatter AVG gives the mean"] = _equal_all(
        average.redistribute([Flat()]).redistribute([Replicate()]), [s / world for s in sums]
    )

    # Local transitions: Replicate -> Flat views this rank's range; Replicate -> Partial keeps the value.
    view = replicated.redistribute([Flat()])
    found["scatter is a view"] = view.local_buffer.untyped_storage().data_ptr() == (
        replicated.local_buffer.untyped_storage().data_ptr()
    ) and all(torch.equal(view.get_local_tensor(i), flat.get_local_tensor(i)) for i in range(len(SHAPES)))
    summed = replicated.redistribute([Partial()])
    found["Replicate -> Partial(SUM) -> Replicate"] = _equal_all(summed.redistribute([Replicate()]), tensors)
    relabelled = replicated.redistribute([Partial(dist.ReduceOp.AVG)])
    shares = relabelled.local_buffer.data_ptr() == replicated.local_buffer.data_ptr()
    found["Replicate -> Partial(AVG) shares the buffer"] = shares
    as_double = flat.cast(torch.float64)
    found["cast"] = _full_tensors_equal(
        _faces(as_double), [t.double() for t in tensors]
    )

    # Storage: released and given back, views taken before still see the buffer.
    before = flat.get_local_tensor(4)
    flat.release_storage()
    found["released storage"] = flat.local_buffer.untyped_storage().nbytes()
    found["use after release"] = _refusal(lambda: flat.redistribute([Replicate()]))
    flat.reallocate_storage()
    flat.local_buffer.fill_(3.0)
    found["views survive a release"] = bool((before == 3.0).all())

    # DCP: saved from world-2 Flat faces; loaded at world 2 into Replicate faces, and at world 1
    # (each rank alone) into Flat faces; saved at world 1 and loaded at world 2 into Flat faces.
    source = DBuffer.distribute_tensors(tensors, mesh, [Flat()])
    dcp.save(_state(source), checkpoint_id=f"{directory}/world2")
    into_replicated = DBuffer(mesh, [Replicate()], SHAPES, torch.float32, "cpu")
    into_replicated.local_buffer.zero_()
    dcp.load(_state(into_replicated), checkpoint_id=f"{directory}/world2")
    found["world 2 -> world 2 Replicate"] = _equal_all(into_replicated, tensors)
    alone = [dist.new_group([r]) for r in range(world)]
    mesh_of_one = DeviceMesh.from_group(alone[rank], "cpu")
    into_one = DBuffer(mesh_of_one, [Flat()], SHAPES, torch.float32, "cpu")
    into_one.local_buffer.zero_()
    dcp.load(_state(into_one), checkpoint_id=f"{directory}/world2", process_group=alone[rank])
    found["world 2 -> world 1"] = _equal_all(into_one, tensors)
    other = _tensors(1)
    if rank == 0:
        written = DBuffer.distribute_tensors(other, mesh_of_one, [Flat()])
        dcp.save(_state(written), checkpoint_id=f"{directory}/world1", process_group=alone[0])
    dist.barrier()
    into_two = DBuffer(mesh, [Flat()], SHAPES, torch.float32, "cpu")
    dcp.load(_state(into_two), checkpoint_id=f"{directory}/world1")
    found["world 1 -> world 2"] = _equal_all(into_two.redistribute([Replicate()]), other)

    # Two mesh axes, both orders of the 2 ranks: (Flat, Flat) is a nested split; all-gathering
    # axis 0 then axis 1 gives the tensors, as do its DTensors; (Replicate, Flat) -> (Flat, Flat)
    # is a view.
    for shape in ((world, 1), (1, world)):
        grid = init_device_mesh("cpu", shape, mesh_dim_names=("outer", "shard"))
        both = DBuffer.distribute_tensors(tensors, grid, [Flat(), Flat()])
        gathered = both.redistribute([Replicate(), Flat()]).redistribute([Replicate(), Replicate()])
        found[f"{shape} all-gathers"] = _equal_all(gathered, tensors)
        found[f"{shape} full_tensor"] = _full_tensors_equal(_faces(both), tensors)
        hsdp = both.redistribute([Replicate(), Flat()])
        found[f"{shape} (Replicate, Flat) -> (Flat, Flat)"] = torch.equal(
            hsdp.redistribute([Flat(), Flat()]).local_buffer, both.local_buffer
        )
        found[f"{shape} mixed get_dtensor"] = _refusal(lambda: hsdp.get_dtensor(0))
        found[f"{shape} Flat before Replicate"] = _refusal(lambda: both.redistribute([Flat(), Replicate()]))
        found[f"{shape} two axes at once"] = _refusal(lambda: both.redistribute([Replicate(), Replicate()]))

    # Refusals: each raises before any collective, on both ranks alike.
    found["refusals"] = {
        "DTensor placement": _refusal(lambda: DBuffer(mesh, [Shard(0)], SHAPES, torch.float32, "cpu")),
        "Partial(MAX)": _refusal(lambda: DBuffer(mesh, [Partial(dist.ReduceOp.MAX)], SHAPES, torch.float32, "cpu")),
        "AVG of integers": _refusal(lambda: DBuffer(mesh, [Partial(dist.ReduceOp.AVG)], SHAPES, torch.int64, "cpu")),
        "placement count": _refusal(lambda: DBuffer(mesh, [Flat(), Flat()], SHAPES, torch.float32, "cpu")),
        "0-dim tensor": _refusal(lambda: DBuffer(mesh, [Flat()], [()], torch.float32, "cpu")),
        "other device": _refusal(lambda: DBuffer(mesh, [Flat()], SHAPES, torch.float32, "meta")),
        "Flat -> Partial": _refusal(lambda: flat.redistribute([Partial()])),
        "allgather of Replicate": _refusal(lambda: replicated.allgather(0)),
        "from_local size": _refusal(lambda: DBuffer.from_local(torch.zeros(5), mesh, [Flat()], SHAPES)),
        "out placements": _refusal(lambda: flat.allgather(0, out=flat)),
        "release a view": _refusal(view.release_storage),
        "rendezvous": _refusal(lambda: flat.rendezvous(0)),
    }
    # The ranks are still in step: one more collective gives the right values.
    found["after the refusals"] = _equal_all(source.redistribute([Replicate()]), tensors)

    # Upstream's fully_shard takes Placements of Flat() (as of DTensor's Shard(0)).
    from megatron_fsdp.experimental import Placements, fully_shard, fully_shard_context

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    whole = [p.detach().clone() for p in layer.parameters()]
    with fully_shard_context():
        fully_shard(layer, mesh, Placements(dp_axes=["dp"], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()]))
    found["fully_shard with Flat()"] = _full_tensors_equal(list(layer.parameters()), whole)
    return found


def test_dbuffer_collectives_views_dtensors_checkpoints_and_refusals_match_one_process() -> None:
    with tempfile.TemporaryDirectory() as directory:
        ranks = run_distributed(_dbuffer_run, 2, directory)
    tensors = _tensors(0)
    for i, tensor in enumerate(tensors):
        pieces = [found["local rows"][i] for found in ranks]
        assert all(p.shape[1:] == tensor.shape[1:] for p in pieces), [p.shape for p in pieces]
        assert torch.equal(torch.cat(pieces), tensor), f"tensor {i}: the ranks' rows are not the tensor"
    for found in ranks:
        failed = [name for name, value in found.items() if value is False]
        assert not failed, f"failed: {failed}"
        assert found["released storage"] == 0
        kind, message = found["use after release"]
        assert kind == "RuntimeError" and "reallocate_storage()" in message, message
    refusals = ranks[0]["refusals"]
    assert ranks[1]["refusals"] == refusals, "the ranks raised different errors"
    assert None not in refusals.values(), [name for name, value in refusals.items() if value is None]
    expected = {
        "DTensor placement": ("TypeError", "Flat() for DTensor's Shard(0)"),
        "Partial(MAX)": ("NotImplementedError", "SUM or ReduceOp.AVG"),
        "AVG of integers": ("ValueError", "floating-point"),
        "placement count": ("ValueError", "one placement per mesh axis"),
        "0-dim tensor": ("ValueError", "give it shape (1,)"),
        "other device": ("ValueError", "put the buffer on cpu"),
        "Flat -> Partial": ("NotImplementedError", "go through Replicate"),
        "allgather of Replicate": ("ValueError", "needs Flat on mesh axis 0"),
        "from_local size": ("ValueError", "holds"),
        "out placements": ("ValueError", "out does not match"),
        "release a view": ("ValueError", "owns the storage"),
        "rendezvous": ("NotImplementedError", "leave the call out"),
    }
    for name, (kind, words) in expected.items():
        assert refusals[name][0] == kind and words in refusals[name][1], (name, refusals[name])
    for shape in ((2, 1), (1, 2)):
        for name, kind, words in (
            ("mixed get_dtensor", "NotImplementedError", "every mesh axis Flat"),
            ("Flat before Replicate", "ValueError", "must be the last ones"),
            ("two axes at once", "NotImplementedError", "one axis per call"),
        ):
            got = ranks[0][f"{shape} {name}"]
            assert got == ranks[1][f"{shape} {name}"] and got[0] == kind and words in got[1], (shape, name, got)



class _Grid:
    """A mesh's sizes and this rank's coordinates, all the layout arithmetic reads of a mesh."""

    def __init__(self, sizes: tuple[int, ...], coordinates: tuple[int, ...]) -> None:
        self.sizes, self.coordinates, self.ndim = sizes, coordinates, len(sizes)

    def size(self, axis: int | None = None) -> int:
        return self.sizes[axis] if axis is not None else int(torch.tensor(self.sizes).prod())

    def get_local_rank(self, axis: int) -> int:
        return self.coordinates[axis]


def test_dbuffer_ranges_nest_over_two_flat_axes_and_cut_between_rows() -> None:
    """On a 2 x 3 mesh (no processes): (Flat, Flat) ranges are the (Replicate, Flat) range cut over
    axis 0 in rank order (what the all-gather over axis 0 concatenates), their order is the one
    megatron_fsdp's flat-sharded DTensors read (shard rank * outer size + outer rank), and every
    range starts and ends between rows of every tensor."""
    from megatron_fsdp.engine.params.piece_dtensor import FlatLayout
    from megatron_fsdp.experimental import Flat, Replicate
    from megatron_fsdp.experimental.dbuffer import _global_layout, _local_range, _piece_index

    shapes = tuple(torch.Size(s) for s in [(3, 4), (5,), (2, 2, 3), (0, 6), (7, 6), (1, 10)])
    sizes = (2, 3)
    layout = _global_layout(shapes, 6)
    assert layout.padded_numel % (6 * 60) == 0  # rows 4, 1, 6, 6, 6, 10: their multiple 60
    rows = [s[1:].numel() for s in shapes]
    for slot, row in zip(layout.slots, rows):
        assert slot.offset % row == 0, (slot, row)
    # Piece i starts at i: which piece a FlatLayout reads as this rank's is then its start.
    numbered = FlatLayout((), (), tuple((i, 0) for i in range(6)), 2)
    for shard_rank in range(3):
        outer = [_Grid(sizes, (o, shard_rank)) for o in range(2)]
        start, length = _local_range(layout, outer[0], (Replicate(), Flat()))
        pieces = [_local_range(layout, grid, (Flat(), Flat())) for grid in outer]
        half = length // 2
        assert pieces == [(start, half), (start + half, half)], (pieces, start, length)
        for grid in outer:
            assert _piece_index(grid, (Flat(), Flat())) == numbered.mine(grid)[0]
            offset, numel = _local_range(layout, grid, (Flat(), Flat()))
            for slot, row in zip(layout.slots, rows):
                for cut in (offset, offset + numel):
                    assert not slot.offset < cut < slot.end or (cut - slot.offset) % row == 0, (slot, row, cut)
