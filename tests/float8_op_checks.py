"""Checks of the float8 weight ops (segment_amax, float8_cast_segments) against float64
references, shared by the CPU tests (test_ops.py) and the CUDA tests (gpu/test_ops_cuda.py):
each takes the device to run on."""

from __future__ import annotations

import pytest
import torch

from megatron_fsdp import _ops

SOURCE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
FLOAT8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# Segments of odd sizes, an empty one, and gaps between them (bucket padding).
BOUNDS = [0, 7, 9, 9, 16, 1039, 1040, 5139]


def _flat(dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(5200, generator=generator, dtype=torch.float64)
    # A spread of magnitudes per segment, so that the scales differ.
    values[16:1039] *= 1e-3
    values[1040:5139] *= 300.0
    return values.to(dtype).to(device)


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[0::2], bounds[1::2]))


def check_segment_amax_matches_float64(device: str) -> None:
    for dtype in SOURCE_DTYPES:
        flat = _flat(dtype, device)
        got = _ops.segment_amax(flat, BOUNDS)
        exact = [flat[lo:hi].double().abs().max().item() if hi > lo else 0.0 for lo, hi in _pairs(BOUNDS)]
        # The maximum is one of the inputs, so only its rounding to float32 may differ.
        expected = torch.tensor(exact, dtype=torch.float64).to(torch.float32)
        assert got.dtype == torch.float32 and got.device.type == torch.device(device).type
        assert torch.equal(got.cpu(), expected), (dtype, got, expected)
    torch.library.opcheck(torch.ops.megatron_fsdp.segment_amax.default, (_flat(torch.float32, device), BOUNDS))


def check_segment_amax_propagates_nan(device: str) -> None:
    flat = _flat(torch.float32, device)
    flat[3] = float("nan")
    flat[2000] = float("inf")
    got = _ops.segment_amax(flat, BOUNDS).cpu()
    assert torch.isnan(got[0]) and torch.isinf(got[3]) and torch.isfinite(got[1:3]).all(), got


def _reference_cast(flat: torch.Tensor, scales: torch.Tensor, float8: torch.dtype) -> torch.Tensor:
    """torchao's weight cast, segment by segment: x * scale in float32, clamped, then to float8."""
    out = torch.zeros(flat.numel(), dtype=float8)
    largest = torch.finfo(float8).max
    for (lo, hi), scale in zip(_pairs(BOUNDS), scales.cpu()):
        scaled = flat[lo:hi].cpu().to(torch.float32) * scale
        out[lo:hi] = scaled.clamp(-largest, largest).to(float8)
    return out


def check_float8_cast_segments_matches_torch_cast(device: str) -> None:
    # From element 0 the CUDA kernel loads and stores several elements at once; from element 1
    # the pointers are misaligned for that and it goes one element at a time.
    for first in (0, 1):
        for dtype in SOURCE_DTYPES:
            for float8 in FLOAT8_DTYPES:
                flat = _flat(dtype, device, seed=1)[first:]
                amax = _ops.segment_amax(flat, BOUNDS)
                scales = (torch.finfo(float8).max / amax.double().clamp(min=1e-12)).float()
                scales[2] *= 4.0  # values beyond the format's range: saturated
                # Prefilled with ones: what no segment covers must come out zero.
                out = torch.full((flat.numel() + first,), 1.0, dtype=float8, device=device)[first:]
                _ops.float8_cast_segments(flat, BOUNDS, scales, out)
                expected = _reference_cast(flat, scales, float8)
                assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8)), (first, dtype, float8)
    flat = _flat(torch.float32, device)
    scales = torch.ones(len(BOUNDS) // 2, device=device)
    out = torch.empty(flat.numel(), dtype=torch.float8_e4m3fn, device=device)
    # test_schema is left out: it compares the mutated float8 out with arithmetic ATen does not
    # implement for float8; the mutation is declared (Tensor(a!) out) and checked above.
    torch.library.opcheck(
        torch.ops.megatron_fsdp.float8_cast_segments.default, (flat, BOUNDS, scales, out),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def check_float8_ops_reject_bad_input(device: str) -> None:
    flat = _flat(torch.float32, device)
    scales = torch.ones(len(BOUNDS) // 2, device=device)
    with pytest.raises(RuntimeError, match="does not lie in the flat buffer"):
        _ops.segment_amax(flat, [0, flat.numel() + 1])
    with pytest.raises(RuntimeError, match="pairs"):
        _ops.segment_amax(flat, [0, 1, 2])
    with pytest.raises(RuntimeError, match="out must be float8"):
        _ops.float8_cast_segments(flat, BOUNDS, scales, torch.empty_like(flat))
    with pytest.raises(RuntimeError, match="scales for"):
        _ops.float8_cast_segments(flat, BOUNDS, scales[:2], torch.empty(flat.numel(), dtype=torch.float8_e4m3fn, device=device))
