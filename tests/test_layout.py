"""layout.py: offsets, padding and shard ranges, without any process group."""

import random

import pytest

from megatron_fsdp.engine.params.layout import alignment_in_elements, build_bucket_layout


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("alignment", [1, 16, 64])
def test_shards_partition_the_bucket_and_every_param_is_covered_once(world_size: int, alignment: int) -> None:
    rng = random.Random(world_size * 100 + alignment)
    for _ in range(20):
        numels = [rng.choice([0, 1, 3, 17, 100, 1000, 4097]) for _ in range(rng.randint(1, 9))]
        layout = build_bucket_layout(numels, world_size, alignment)
        assert layout.padded_numel % (world_size * alignment) == 0
        assert layout.padded_numel >= sum(numels)
        previous_end = 0
        for slot, numel in zip(layout.slots, numels):
            assert slot.offset % alignment == 0, "every parameter starts aligned"
            assert slot.offset >= previous_end, "parameters never overlap"
            assert slot.numel == numel
            previous_end = slot.end
        assert previous_end <= layout.padded_numel
        ranges = [layout.shard_range(rank) for rank in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "shards are contiguous and back to back"
        assert len({end - start for start, end in ranges}) == 1, "every shard has the same size"
        covered_by = [0] * layout.padded_numel
        for start, end in [(slot.offset, slot.end) for slot in layout.slots] + layout.padding_ranges():
            for element in range(start, end):
                covered_by[element] += 1
        assert covered_by == [1] * layout.padded_numel, "parameters and padding tile the bucket exactly once"
        for index, slot in enumerate(layout.slots):
            pieces = [layout.local_range(index, rank) for rank in range(world_size)]
            covered = sum(end - start for start, end in pieces)
            assert covered == slot.numel, f"param {index} covered {covered} of {slot.numel} elements"
            for start, end in pieces:
                if end > start:
                    assert slot.offset <= start and end <= slot.end


def test_a_parameter_can_straddle_shards_and_a_shard_can_be_empty_of_params() -> None:
    layout = build_bucket_layout([10, 3], world_size=8, alignment=1)
    assert layout.padded_numel == 16 and layout.shard_numel == 2
    owners = [rank for rank in range(8) if layout.local_range(0, rank)[1] > layout.local_range(0, rank)[0]]
    assert owners == [0, 1, 2, 3, 4], "the first parameter straddles five shards"
    assert all(start == end for start, end in (layout.local_range(i, 7) for i in range(2))), "rank 7 holds only padding"
    assert layout.local_range(1, 5) == (10, 12) and layout.local_range(1, 6) == (12, 13)


def test_offsets_follow_alignment_and_padding_rounds_to_world_times_alignment() -> None:
    layout = build_bucket_layout([5, 7, 1], world_size=3, alignment=4)
    assert [s.offset for s in layout.slots] == [0, 8, 16]
    assert layout.padded_numel == 24  # 20 rounded up to a multiple of 3 * 4
    assert layout.padding_ranges() == [(5, 8), (15, 16), (17, 24)]
    assert alignment_in_elements(128, 4) == 32 and alignment_in_elements(128, 2) == 64
    assert alignment_in_elements(2, 8) == 1


def test_bad_layout_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="world_size"):
        build_bucket_layout([1], world_size=0, alignment=1)
    with pytest.raises(ValueError, match="elements"):
        build_bucket_layout([-1], world_size=1, alignment=1)
    with pytest.raises(ValueError, match="outside a world"):
        build_bucket_layout([1], world_size=2, alignment=1).shard_range(2)


@pytest.mark.parametrize("shape", [(), (7,), (5, 3), (4, 3, 5), (2, 3, 1, 4)])
def test_rectangular_chunks_tile_every_flat_range_exactly_once(shape) -> None:
    import torch

    from megatron_fsdp.engine.params.layout import flat_offset, rectangular_chunks

    numel = int(torch.tensor(shape).prod().item()) if shape else 1
    values = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for end in range(start, numel + 1):
            chunks = rectangular_chunks(shape, start, end)
            covered = []
            for offsets, sizes in chunks:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                block = values[index].reshape(-1)
                lo = flat_offset(shape, offsets)
                assert block.tolist() == list(range(lo, lo + block.numel())), "each chunk is a contiguous flat range"
                covered.extend(block.tolist())
            assert covered == list(range(start, end)), f"{shape} [{start}, {end}) -> {chunks}"
            assert len(chunks) <= max(2 * len(shape) - 1, 1), "a partial first row, whole rows, a partial last row, recursively"
