"""Nothing keys on int32 (issue 60): a 405B layer is 3.2B elements in one bucket at TP 1, so the C++
ops take offsets past 2^31 elements. Each op here works on a bf16 bucket of 2^31 + 8,192
elements (4 GiB of address space) at an offset past 2^31, against plain torch on the same
elements. The bucket is never filled: the host allocator maps it lazily, so only the pages the
ops touch (a few hundred KiB) become memory, and the test runs on a small machine.
(tests/test_simulate.py carries such a bucket through the whole wrap and step under fake tensors.)"""

from __future__ import annotations

import resource

import torch

from megatron_fsdp import _ops

NUMEL = 2**31 + 8192
OFFSET = 2**31 + 64  # past int32, aligned as a bucket slot is


def test_ops_read_and_write_a_bucket_past_two_to_the_31_elements() -> None:
    flat = torch.empty(NUMEL, dtype=torch.bfloat16)
    source = torch.randn(40, 50, dtype=torch.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    _ops.flatten_copy([source], [OFFSET], flat)  # cast to bf16 on the way in
    expected = source.to(torch.bfloat16).reshape(-1)
    assert torch.equal(flat[OFFSET : OFFSET + 2000], expected)

    (view,) = _ops.param_views(flat, [OFFSET], [source.shape])
    assert view.shape == source.shape and view.storage_offset() == OFFSET
    assert torch.equal(view, expected.view(source.shape))

    back = torch.empty(40, 50, dtype=torch.float32)
    _ops.unflatten_copy(flat, [OFFSET], [back])
    assert torch.equal(back, expected.float().view(40, 50))

    amax = _ops.segment_amax(flat, [OFFSET, OFFSET + 2000])
    assert amax.item() == expected.float().abs().max().item()

    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024, f"the ops touched {grown_kib} KiB of the lazily mapped bucket"
