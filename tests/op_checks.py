"""Checks of every C++ op against a float64 reference, shared by the CPU tests (test_ops.py) and
the CUDA tests (gpu/test_ops_cuda.py): each takes the device to run on."""

from __future__ import annotations

import torch

from megatron_fsdp import _ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Odd sizes, none a multiple of a vector width, plus empty and single-element tensors.
ODD_SIZES = [0, 1, 3, 7, 129, 1023, 4099]

# Unit roundoff of each dtype: a correctly rounded result is within this relative error.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _random(numel: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype).to(device)


def check_param_views_share_storage(device: str) -> None:
    flat = torch.zeros(40, device=device)
    shapes = [torch.Size([2, 3]), torch.Size([7]), torch.Size([]), torch.Size([3, 1, 2])]
    offsets = [0, 8, 15, 16]
    views = _ops.param_views(flat, offsets, shapes)
    assert [v.shape for v in views] == shapes
    for value, (view, offset) in enumerate(zip(views, offsets), start=1):
        view.fill_(value)
        assert torch.all(flat[offset : offset + view.numel()] == value)
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    flat[8:15] = -1.0
    assert torch.all(views[1] == -1.0), "a write into the buffer must be seen through the view"
    # AOT dispatch is left out: PyTorch cannot functionalize a custom op whose outputs alias an
    # input, and a view-returning op is exactly that. Views are made when buffers are set up,
    # outside any compiled region, so schema, fake kernel and autograd registration are what count.
    torch.library.opcheck(
        torch.ops.megatron_fsdp.param_views.default,
        (flat, offsets, [2, 3, 7, 3, 1, 2], [2, 1, 0, 3]),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def check_flatten_copy_casts_exactly(device: str) -> None:
    for src_dtype in DTYPES:
        for flat_dtype in DTYPES:
            srcs = [_random(n, src_dtype, device, seed=n).view(-1) for n in ODD_SIZES]
            srcs.append(_random(35, src_dtype, device, seed=3).view(5, 7).t())  # non-contiguous source
            offsets, cursor = [], 5
            for src in srcs:
                offsets.append(cursor)
                cursor += src.numel() + 3
            flat = torch.full((cursor + 2,), 7.0, dtype=flat_dtype, device=device)
            _ops.flatten_copy(srcs, offsets, flat)
            for src, offset in zip(srcs, offsets):
                got = flat[offset : offset + src.numel()]
                # Reference: the float64 value rounded once to the flat dtype (the source values are
                # exact in float64, so this is the correctly rounded cast).
                expected = src.reshape(-1).to(torch.float64).to(flat_dtype)
                assert torch.equal(got, expected), f"{src_dtype}->{flat_dtype} numel {src.numel()}: max err {(got.double() - expected.double()).abs().max()}"
            assert torch.all(flat[:5] == 7.0), "bytes outside the segments must stay untouched"

            dsts = [torch.empty(src.shape, dtype=src_dtype, device=device).contiguous() for src in srcs]
            _ops.unflatten_copy(flat, offsets, dsts)
            for dst, offset in zip(dsts, offsets):
                expected = flat[offset : offset + dst.numel()].to(torch.float64).to(src_dtype)
                assert torch.equal(dst.reshape(-1), expected), f"unflatten {flat_dtype}->{src_dtype} numel {dst.numel()}"
    flat = torch.zeros(64, device=device)
    srcs = [torch.randn(5, 3, device=device), torch.randn(11, device=device, dtype=torch.bfloat16)]
    torch.library.opcheck(torch.ops.megatron_fsdp.flatten_copy.default, (srcs, [1, 20], flat))
    torch.library.opcheck(torch.ops.megatron_fsdp.unflatten_copy.default, (flat, [1, 20], [torch.empty(5, 3, device=device), torch.empty(11, device=device)]))


def _reduce_bound(chunks: torch.Tensor, scale: float, previous: torch.Tensor, out_dtype: torch.dtype, expected: torch.Tensor) -> torch.Tensor:
    """Error bound of one summation in the accumulation dtype followed by one rounding to out_dtype."""
    acc_roundoff = UNIT_ROUNDOFF[torch.float64 if torch.float64 in (chunks.dtype, out_dtype) else torch.float32]
    magnitude = abs(scale) * chunks.double().abs().sum(0) + previous.double().abs()
    # Below the smallest normal the spacing is fixed, so rounding there has an absolute bound.
    subnormal = UNIT_ROUNDOFF[out_dtype] * torch.finfo(out_dtype).smallest_normal
    return UNIT_ROUNDOFF[out_dtype] * expected.abs() + subnormal + (chunks.shape[0] + 2) * acc_roundoff * magnitude


def check_promoting_reduce_matches_float64(device: str) -> None:
    for in_dtype in DTYPES:
        for out_dtype in DTYPES:
            for world in (1, 2, 3, 8):
                for n in ODD_SIZES:
                    chunks = _random(world * n, in_dtype, device, seed=world * 100 + n).view(world, n)
                    previous = _random(n, out_dtype, device, seed=n + 7)
                    for accumulate, scale in ((False, 1.0), (False, 1.0 / world), (True, 0.37)):
                        out = previous.clone()
                        _ops.promoting_reduce(chunks, out, scale=scale, accumulate=accumulate)
                        expected = chunks.double().sum(0) * scale + (previous.double() if accumulate else 0.0)
                        bound = _reduce_bound(chunks, scale, previous if accumulate else torch.zeros_like(previous), out_dtype, expected)
                        err = (out.double() - expected).abs()
                        assert torch.all(err <= bound), f"{in_dtype}->{out_dtype} world {world} n {n} acc {accumulate}: max err {err.max()} > bound {bound.max()}"
    # Sizes the 16-byte vector path takes, one beyond a whole GPU's threads times the kernel's
    # unrolling (the grid-stride loop and its partial last step).
    for n in (8 * 1024, 8 * 1_100_003):
        for in_dtype, world in ((torch.bfloat16, 1), (torch.float32, 3)):
            chunks = _random(world * n, in_dtype, device, seed=n + world).view(world, n)
            previous = _random(n, torch.float32, device, seed=n)
            for accumulate in (False, True):
                out = previous.clone()
                _ops.promoting_reduce(chunks, out, accumulate=accumulate)
                expected = chunks.double().sum(0) + (previous.double() if accumulate else 0.0)
                bound = _reduce_bound(chunks, 1.0, previous if accumulate else torch.zeros_like(previous), torch.float32, expected)
                assert torch.all((out.double() - expected).abs() <= bound), f"{in_dtype} world {world} n {n} acc {accumulate}"
    chunks = torch.randn(3, 33, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.megatron_fsdp.promoting_reduce.default, (chunks, 0.5, True, torch.randn(33, device=device)))


def check_promoting_reduce_beats_low_precision_sum(device: str) -> None:
    """bf16 chunks summed in fp32 land closer to the exact sum than a bf16 running sum, as a ring
    reduce-scatter in bf16 computes it (every partial sum rounded to bf16)."""
    world, n = 8, 1 << 16
    chunks = _random(world * n, torch.bfloat16, device, seed=11).view(world, n)
    exact = chunks.double().sum(0)
    promoted = torch.empty(n, dtype=torch.float32, device=device)
    _ops.promoting_reduce(chunks, promoted)
    running = chunks[0].clone()
    for r in range(1, world):
        running = running + chunks[r]
    promoted_err = (promoted.double() - exact).abs().mean().item()
    low_err = (running.double() - exact).abs().mean().item()
    # fp32 accumulation of 8 bf16 values is exact to ~2^-24 relative; the bf16 running sum rounds
    # 7 times at 2^-9 relative, so the gap is orders of magnitude; 100x leaves a wide margin.
    assert promoted_err * 100 < low_err, f"promoting reduce error {promoted_err} vs bf16 sum error {low_err}"


def check_find_non_finite_flags_each_tensor(device: str) -> None:
    for dtype in DTYPES:
        tensors = [_random(n, dtype, device, seed=n) for n in ODD_SIZES]
        assert not _ops.find_non_finite(tensors).any()
        poison = {1: float("nan"), 3: float("inf"), 6: float("-inf")}
        for index, value in poison.items():
            tensors[index][tensors[index].numel() // 2] = value
        flags = _ops.find_non_finite(tensors)
        assert flags.device.type == torch.device(device).type
        expected = [i in poison for i in range(len(tensors))]
        assert flags.cpu().tolist() == expected, f"{dtype}: {flags.tolist()} != {expected}"
    assert _ops.find_non_finite([]).shape == (0,)
    big = torch.finfo(torch.float32).max * torch.ones(9, dtype=torch.float64, device=device) * 4
    assert not _ops.find_non_finite([big]).any(), "a finite fp64 value beyond the fp32 range is finite"
    torch.library.opcheck(torch.ops.megatron_fsdp.find_non_finite.default, ([torch.randn(5, device=device), torch.randn(3, 2, device=device)],))


# Norm types: the two special-cased ones, a non-integer, an integer that takes the general path, inf.
NORM_TYPES = [1.0, 2.0, 2.5, 3.0, float("inf")]
# The op keeps partial sums in float64 and rounds to float32 once, so an entry is within one float32
# ulp (2**-24 relative) of the float64 reference; 4 ulps is the op's "few ulps" promise, still far
# below the ~1e-5 that a sequential float32 sum over the 2**20 + 3 elements below would miss by.
NORM_RTOL = 4 * UNIT_ROUNDOFF[torch.float32]


def _norm_reference(x: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The op's value in float64: sum(|x| ** p), or max(|x|) for p = inf (0 when x is empty)."""
    x = x.double().reshape(-1)
    if norm_type == float("inf"):
        return x.abs().max() if x.numel() else x.new_zeros(())
    return torch.linalg.vector_norm(x, norm_type) ** norm_type


def _assert_norms_match(tensors: list[torch.Tensor], norm_type: float, what: str) -> None:
    got = _ops.multi_tensor_norm(tensors, norm_type)
    assert got.dtype == torch.float32 and got.shape == (len(tensors),)
    assert got.device == tensors[0].device
    expected = torch.stack([_norm_reference(x, norm_type) for x in tensors])
    err = (got.double() - expected).abs()
    bound = NORM_RTOL * expected
    worst = int((err - bound).argmax())
    assert torch.all(err <= bound), f"{what} p={norm_type}: tensor {worst} ({tensors[worst].numel()} elements, {tensors[worst].dtype}) got {got[worst].item()}, expected {expected[worst].item()}, rel err {(err[worst] / expected[worst]).item():.3g} > {NORM_RTOL:.3g}"


def check_multi_tensor_norm_matches_float64(device: str) -> None:
    for dtype in DTYPES:
        tensors = [_random(n, dtype, device, seed=n) for n in ODD_SIZES]
        tensors.append(_random(2**20 + 3, dtype, device, seed=5))  # many chunks in one tensor
        tensors.append(_random(4100, dtype, device, seed=6)[1:])  # contiguous, not 16-byte aligned
        for norm_type in NORM_TYPES:
            _assert_norms_match(tensors, norm_type, str(dtype))
    # Dtypes interleaved, so a kernel that groups tensors by dtype must put each entry back in place.
    sizes = [129, 0, 4099, 2**16 + 5, 7, 1023, 40000, 3]
    mixed = [_random(n, DTYPES[i % len(DTYPES)], device, seed=i) for i, n in enumerate(sizes)]
    for norm_type in NORM_TYPES:
        _assert_norms_match(mixed, norm_type, "mixed dtypes")
    assert _ops.multi_tensor_norm([]).shape == (0,)
    small = [torch.randn(5, device=device), torch.randn(3, 2, device=device, dtype=torch.bfloat16)]
    for norm_type in (2.0, float("inf")):
        torch.library.opcheck(torch.ops.megatron_fsdp.multi_tensor_norm.default, (small, norm_type))


def check_multi_tensor_norm_propagates_nan_and_inf(device: str) -> None:
    nan, inf = float("nan"), float("inf")
    for dtype in DTYPES:
        tensors = [_random(n, dtype, device, seed=n) for n in (4099, 2**20 + 3, 1, 4099, 2**20 + 3, 129)]
        tensors[0][0] = nan  # first element
        tensors[1][-1] = nan  # last element of the last chunk
        tensors[2][0] = -inf
        tensors[3][2049] = inf
        tensors[4][5] = nan  # NaN before an Inf in a later chunk: NaN wins
        tensors[4][2**19] = inf
        for norm_type in NORM_TYPES:
            got = _ops.multi_tensor_norm(tensors, norm_type).cpu()
            shown = f"{dtype} p={norm_type}: {got.tolist()}"
            assert got[[0, 1, 4]].isnan().all(), f"NaN must give NaN; {shown}"
            assert torch.all(got[[2, 3]] == inf), f"Inf must give Inf; {shown}"
            assert got[5].isfinite(), f"a finite tensor must stay finite; {shown}"


def check_multi_tensor_norm_rejects_bad_input(device: str) -> None:
    good = torch.randn(6, device=device)
    cases = [
        ([good, torch.randn(5, 7, device=device).t()], 2.0, "tensor 1 must be contiguous"),
        ([good], 0.0, "norm_type must be > 0 (a finite p or inf), got 0"),
        ([good], -2.0, "norm_type must be > 0 (a finite p or inf), got -2"),
        ([good], float("nan"), "norm_type must be > 0"),
        ([torch.ones(3, dtype=torch.int32, device=device)], 2.0, "must be float32, float64, float16 or bfloat16"),
    ]
    for tensors, norm_type, message in cases:
        try:
            _ops.multi_tensor_norm(tensors, norm_type)
        except RuntimeError as error:
            assert message in str(error), f"p={norm_type}: {message!r} not in {str(error)!r}"
        else:
            raise AssertionError(f"multi_tensor_norm must reject {message!r} (p={norm_type})")


def check_bucket_pool_reuses_memory(device: str) -> None:
    pool = _ops.new_bucket_pool(double_buffer=False)
    dev = torch.device(device)
    # CUDA hands released blocks back to torch's caching allocator; the CPU pool caches them.
    cached = 1 if dev.type == "cpu" else 0
    bucket = pool.placeholder(1000, torch.float32, dev)
    assert bucket.shape == (1000,) and bucket.untyped_storage().nbytes() == 0
    pool.fill(bucket, "weights")
    views = _ops.param_views(bucket, [0, 600], [torch.Size([20, 30]), torch.Size([400])])
    bucket.copy_(torch.arange(1000, dtype=torch.float32, device=dev))
    first_ptr = bucket.data_ptr()
    assert pool.bytes_in_use() == 4096 and pool.high_water_mark() == 4096
    pool.release(bucket)
    assert bucket.untyped_storage().nbytes() == 0 and pool.bytes_in_use() == 0
    assert pool.bytes_reserved() == cached * 4096
    pool.fill(bucket, "weights")
    assert bucket.data_ptr() == first_ptr or not cached, "the cached block must come back for the same size"
    assert views[1][0].item() == 600.0, "views made under an earlier lease see the new lease's memory"
    for _ in range(50):  # many fetch/release cycles reserve nothing new
        temp = pool.fetch(1000, torch.bfloat16, dev, "grads")
        pool.release(temp)
    assert pool.bytes_reserved() == 4096 + cached * 2048
    pool.release(bucket)
    pool.empty_cache()
    assert pool.bytes_reserved() == 0 and pool.high_water_mark() == 4096 + 2048, "peak: the weight bucket and one temporary at once"
    try:
        pool.release(bucket)
    except RuntimeError as error:
        assert "holds no pool memory" in str(error)
    else:
        raise AssertionError("releasing twice must fail")


def check_bucket_pool_double_buffer_bounds_memory(device: str) -> None:
    pool = _ops.new_bucket_pool(double_buffer=True)
    assert pool.double_buffer()
    dev = torch.device(device)
    sizes = [300, 1000, 700, 1000, 50]
    live = []
    for size in sizes:
        if len(live) == 2:
            pool.release(live.pop(0))
        live.append(pool.fetch(size, torch.float32, dev, "weights"))
    # Alternating buckets: two persistent blocks, each grown to the largest request it served.
    assert pool.blocks_per_key() == {"weights": 2}
    assert pool.bytes_reserved() <= 2 * 4096
    # A third live bucket gets a third block, kept for the next time three are live.
    third = pool.fetch(10, torch.float32, dev, "weights")
    assert pool.blocks_per_key() == {"weights": 3}
    other = pool.fetch(10, torch.float32, dev, "grads")  # another key has its own blocks
    for bucket in live + [third, other]:
        pool.release(bucket)
    assert pool.bytes_in_use() == 0
    reserved = pool.bytes_reserved()
    again = [pool.fetch(size, torch.float32, dev, "weights") for size in (1000, 700, 10)]
    for bucket in again:
        pool.release(bucket)
    assert pool.bytes_reserved() == reserved, "the same pattern again must reuse the persistent blocks"
    assert pool.blocks_per_key() == {"weights": 3, "grads": 1}


def check_bucket_pool_moves_new_blocks_keeping_contents(device: str) -> None:
    pool = _ops.new_bucket_pool(double_buffer=True)
    dev = torch.device(device)
    kept = pool.fetch(1000, torch.float32, dev, "weights")
    view = kept[10:20]
    kept.copy_(torch.arange(1000, dtype=torch.float32, device=dev))
    pool.release(pool.fetch(300, torch.bfloat16, dev, "grads"))
    old_address = kept.data_ptr()
    reserved = pool.bytes_reserved()
    assert pool.move_new_blocks() == 2, "one lent and one idle block were never moved"
    assert kept.data_ptr() != old_address, "a moved lent bucket must sit in the new memory"
    assert torch.equal(kept.cpu(), torch.arange(1000, dtype=torch.float32)), "moving must keep a lent bucket's contents"
    assert torch.equal(view.cpu(), torch.arange(10, 20, dtype=torch.float32)), "views must follow the bucket"
    assert pool.bytes_reserved() == reserved and pool.blocks_per_key() == {"weights": 1, "grads": 1}
    assert pool.move_new_blocks() == 0, "moved blocks stay where they are"
    pool.release(pool.fetch(10, torch.float32, dev, "other"))
    assert pool.move_new_blocks() == 1, "only the block allocated since the last move"
    pool.release(kept)
    try:
        _ops.new_bucket_pool(double_buffer=False).move_new_blocks()
    except RuntimeError as error:
        assert "double_buffer" in str(error)
    else:
        raise AssertionError("a pool without persistent blocks has nothing to move and must say so")


def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC-32C (reflected polynomial 0x82F63B78), continuing from ``crc``."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def check_crc32c_matches_a_reference(device: str) -> None:
    """Host-only op (it checksums file bytes): checked on the CPU whatever ``device`` is."""
    check_value = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert _ops.crc32c(check_value) == 0xE3069283, "the standard CRC-32C check value"
    assert _ops.crc32c(torch.zeros(0, dtype=torch.uint8), seed=0x1234) == 0x1234, "no bytes keep the seed"
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randint(0, 256, (13 << 20,), dtype=torch.uint8, generator=generator)
    for start, length in ((0, 1), (1, 7), (3, 8), (5, 1023), (8, 4099)):  # odd lengths and alignments
        data = bytes(buffer[start : start + length].tolist())
        assert _ops.crc32c(buffer[start : start + length]) == _crc32c_reference(data), f"{length} bytes at {start}"
        assert _ops.crc32c(buffer[start : start + length], seed=77) == _crc32c_reference(data, 77), f"seeded, {length} bytes"
    # 13 MiB runs as one piece (of at least 4 MiB) per thread, whose CRCs are combined; every split
    # of it and every thread count must give the CRC of the whole.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _ops.crc32c(buffer)  # one piece: no combining
        torch.set_num_threads(3)
        assert _ops.crc32c(buffer) == whole, "3 pieces"
    finally:
        torch.set_num_threads(threads)
    for cut in (1, (4 << 20) + 3, buffer.numel() - 5):
        assert _ops.crc32c(buffer[cut:], seed=_ops.crc32c(buffer[:cut])) == whole, f"split at {cut}"
    for bad, message in ((torch.zeros(4), "must be a uint8 tensor"), (buffer[:64].view(8, 8).t(), "must be contiguous")):
        try:
            _ops.crc32c(bad)
        except RuntimeError as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"crc32c must reject input that {message}")
    torch.library.opcheck(torch.ops.megatron_fsdp.crc32c.default, (buffer[:100], 5))


# Optimizer steps (adam_step_, sgd_step_). (size, offset) cases: odd sizes, one that the CPU kernel
# splits over several threads (tasks of 2**16 elements), and buffers starting one element into their
# storage, which the CUDA kernel cannot load in 16-byte vectors.
STEP_CASES = [(n, 0) for n in ODD_SIZES + [2**17 + 5]] + [(4099, 1)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32_ROUNDOFF = UNIT_ROUNDOFF[torch.float32]
# A float32 result below the smallest normal is off by up to half the subnormal spacing.
F32_SUBNORMAL_ROUNDOFF = 2.0**-150


def _step_buffer(n: int, offset: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    return _random(n + offset, dtype, device, seed)[offset:]


def _f32(value: float) -> float:
    """``value`` rounded to float32, as ATen rounds a Python float scalar for a float32 kernel."""
    return float(torch.tensor(value, dtype=torch.float32))


class _Bounded:
    """A float64 tensor and a bound on the distance of the op's float32 result from it. Every
    float32 operation rounds its result to within ``u * |result|``; earlier errors carry through
    (products of errors included). A fused multiply-add rounds once where this counts two roundings,
    so the bound holds for fused and unfused kernels alike."""

    def __init__(self, value: torch.Tensor, err: torch.Tensor | None = None) -> None:
        self.value = value
        self.err = torch.zeros_like(value) if err is None else err

    @staticmethod
    def rounded(value: torch.Tensor, err: torch.Tensor) -> "_Bounded":
        return _Bounded(value, err + F32_ROUNDOFF * (value.abs() + err) + F32_SUBNORMAL_ROUNDOFF)

    @staticmethod
    def of(x: "_Bounded | float") -> "_Bounded":
        return x if isinstance(x, _Bounded) else _Bounded(torch.tensor(float(x), dtype=torch.float64))

    def __neg__(self) -> "_Bounded":
        return _Bounded(-self.value, self.err)

    def __add__(self, other: "_Bounded | float") -> "_Bounded":
        other = _Bounded.of(other)
        return _Bounded.rounded(self.value + other.value, self.err + other.err)

    def __sub__(self, other: "_Bounded | float") -> "_Bounded":
        return self + (-_Bounded.of(other))

    def __mul__(self, other: "_Bounded | float") -> "_Bounded":
        other = _Bounded.of(other)
        err = self.value.abs() * other.err + other.value.abs() * self.err + self.err * other.err
        return _Bounded.rounded(self.value * other.value, err)

    def __truediv__(self, other: "_Bounded | float") -> "_Bounded":
        other = _Bounded.of(other)
        quotient = self.value / other.value
        err = (self.err + quotient.abs() * other.err) / (other.value.abs() - other.err)
        return _Bounded.rounded(quotient, err)

    def sqrt(self) -> "_Bounded":
        root = self.value.sqrt()
        # |sqrt(a) - sqrt(b)| <= |a - b| / sqrt(a), and <= sqrt(|a - b|) near 0.
        relative = torch.where(root > 0, self.err / root, torch.full_like(root, float("inf")))
        return _Bounded.rounded(root, torch.minimum(relative, self.err.sqrt()))

    def maximum(self, other: "_Bounded") -> "_Bounded":
        return _Bounded(torch.maximum(self.value, other.value), torch.maximum(self.err, other.err))


def _assert_within(got: torch.Tensor, expected: _Bounded, what: str) -> None:
    err = (got.cpu().double() - expected.value).abs()
    worst = int((err - expected.err).argmax()) if err.numel() else 0
    assert torch.all(err <= expected.err), f"{what}: element {worst} got {got.flatten()[worst].item()}, expected {expected.value[worst].item()} +- {expected.err[worst].item():.3g}"


ADAM_CONFIGS = [
    {},
    {"weight_decay": 0.1},
    {"weight_decay": 0.1, "decoupled_weight_decay": True},
    {"maximize": True},
    {"amsgrad": True, "weight_decay": 0.1},
    {"betas": (0.3, 0.99)},  # 1 - beta1 >= 0.5: ATen's lerp takes its other form
]


def _adam_reference(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False, amsgrad=False, maximize=False) -> dict[str, _Bounded]:
    """torch.optim.Adam's single-tensor update in float64 with an error bound: its scalars are
    computed in double and rounded to float32 once, as ATen receives them."""
    beta1, beta2 = betas
    p, g, m, v = (_Bounded(t.cpu().double()) for t in (param, grad, exp_avg, exp_avg_sq))
    if maximize:
        g = -g
    if weight_decay != 0 and decoupled_weight_decay:
        p = p * _f32(1 - lr * weight_decay)
    elif weight_decay != 0:
        g = g + p * _f32(weight_decay)
    weight = _f32(1 - beta1)
    diff = g - m
    m = m + diff * weight if weight < 0.5 else g + diff * (weight - 1.0)
    v = v * _f32(beta2) + g * _f32(1 - beta2) * g
    second_moment = v
    result = {}
    if amsgrad:
        second_moment = _Bounded(max_exp_avg_sq.cpu().double()).maximum(v)
        result["max_exp_avg_sq"] = second_moment
    denom = second_moment.sqrt() / _f32((1 - beta2**step) ** 0.5) + _f32(eps)
    p = p + m * _f32(-(lr / (1 - beta1**step))) / denom
    result.update(param=p, exp_avg=m, exp_avg_sq=v)
    return result


def check_adam_step_matches_float64(device: str) -> None:
    for grad_dtype in GRAD_DTYPES:
        for config in ADAM_CONFIGS:
            for n, offset in STEP_CASES:
                for step in (1, 7):
                    param = _step_buffer(n, offset, torch.float32, device, seed=n)
                    grad = _step_buffer(n, offset, grad_dtype, device, seed=n + 1)
                    exp_avg = _step_buffer(n, offset, torch.float32, device, seed=n + 2).mul_(0.1)
                    exp_avg_sq = _step_buffer(n, offset, torch.float32, device, seed=n + 3).square_().mul_(0.01)
                    max_exp_avg_sq = _step_buffer(n, offset, torch.float32, device, seed=n + 4).square_().mul_(0.02) if config.get("amsgrad") else None
                    states = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq}
                    expected = _adam_reference(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr=0.01, **config)
                    _ops.adam_step_(param, grad, exp_avg, exp_avg_sq, step=step, lr=0.01, max_exp_avg_sq=max_exp_avg_sq, **config)
                    for name, bounded in expected.items():
                        _assert_within(states[name], bounded, f"adam {config} grad {grad_dtype} n {n} offset {offset} step {step} {name}")
    param, exp_avg, exp_avg_sq, max_exp_avg_sq = (torch.rand(33, device=device) for _ in range(4))
    weights_out = torch.empty(33, device=device, dtype=torch.bfloat16)
    for grad in (torch.randn(33, device=device), torch.randn(33, device=device, dtype=torch.bfloat16)):
        for max_sq, amsgrad in ((None, False), (max_exp_avg_sq, True)):
            args = (param, grad, exp_avg, exp_avg_sq, max_sq, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3, True, amsgrad, False)
            torch.library.opcheck(torch.ops.megatron_fsdp.adam_step_.default, args)
            torch.library.opcheck(torch.ops.megatron_fsdp.adam_step_.default, (*args, weights_out))


SGD_CONFIGS = [
    {},
    {"weight_decay": 0.1},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1, "maximize": True},
]


def _sgd_reference(param, grad, momentum_buffer, first_step, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False) -> dict[str, _Bounded]:
    """torch.optim.SGD's single-tensor update in float64 with an error bound."""
    p, g = _Bounded(param.cpu().double()), _Bounded(grad.cpu().double())
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + p * _f32(weight_decay)
    result = {}
    if momentum != 0:
        buf = g if first_step else _Bounded(momentum_buffer.cpu().double()) * _f32(momentum) + g * _f32(1 - dampening)
        result["momentum_buffer"] = buf
        g = g + buf * _f32(momentum) if nesterov else buf
    result["param"] = p + g * _f32(-lr)
    return result


def check_sgd_step_matches_float64(device: str) -> None:
    for grad_dtype in GRAD_DTYPES:
        for config in SGD_CONFIGS:
            for n, offset in STEP_CASES:
                for first_step in (True, False):
                    param = _step_buffer(n, offset, torch.float32, device, seed=n)
                    grad = _step_buffer(n, offset, grad_dtype, device, seed=n + 1)
                    buffer = _step_buffer(n, offset, torch.float32, device, seed=n + 2) if config.get("momentum") else None
                    states = {"param": param, "momentum_buffer": buffer}
                    expected = _sgd_reference(param, grad, buffer, first_step, lr=0.1, **config)
                    _ops.sgd_step_(param, grad, buffer, lr=0.1, first_step=first_step, **config)
                    for name, bounded in expected.items():
                        _assert_within(states[name], bounded, f"sgd {config} grad {grad_dtype} n {n} offset {offset} first {first_step} {name}")
    param, buffer = torch.randn(33, device=device), torch.randn(33, device=device)
    weights_out = torch.empty(33, device=device, dtype=torch.float16)
    for grad in (torch.randn(33, device=device), torch.randn(33, device=device, dtype=torch.float16)):
        torch.library.opcheck(torch.ops.megatron_fsdp.sgd_step_.default, (param, grad, buffer, 0.1, 0.9, 0.0, 0.01, True, False, False))
        torch.library.opcheck(torch.ops.megatron_fsdp.sgd_step_.default, (param, grad, None, 0.1, 0.0, 0.0, 0.0, False, True, True))
        torch.library.opcheck(torch.ops.megatron_fsdp.sgd_step_.default, (param, grad, buffer, 0.1, 0.9, 0.0, 0.01, True, False, False, weights_out))


WEIGHTS_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (size, offset of the step's buffers, offset of weights_out): the step cases, plus weights_out
# alone one element into its storage, which takes the CUDA kernel off its vector stores.
WEIGHTS_CASES = [(n, offset, offset) for n, offset in STEP_CASES] + [(4099, 0, 1)]
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns, so that equal means bit-identical."""
    return t.view(_BITS[t.dtype])


def _assert_bit_identical(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    differ = _bits(got) != _bits(expected)
    if differ.any():
        first = int(differ.nonzero()[0])
        raise AssertionError(f"{what}: element {first} got {got[first].item()!r}, expected {expected[first].item()!r} ({int(differ.sum())} differ)")


def _assert_identical_but_nan_payloads(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit for bit, except that a NaN may come out with another payload or sign."""
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaNs at other places than expected"
    _assert_bit_identical(torch.where(nan, expected, got), expected, what)


def _assert_cast_like_tensor_to(weights_out: torch.Tensor, param: torch.Tensor, what: str) -> None:
    """``weights_out`` is ``param.to(weights_out.dtype)`` (ATen's own vector and scalar
    conversions give NaNs different payloads)."""
    _assert_identical_but_nan_payloads(weights_out, param.to(weights_out.dtype), what)


def _wide_param(n: int, offset: int, device: str, seed: int) -> torch.Tensor:
    """Params of magnitude 2^-40..2^20: stepped with a small lr, their fp16 casts take in
    subnormals, zeros and infinities as well as normal numbers."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-40, 20, (n + offset,), generator=generator).double()
    return (_random(n + offset, torch.float64, "cpu", seed) * exponents.exp2()).float().to(device)[offset:]


def check_optimizer_steps_write_weights_out_like_tensor_to(device: str) -> None:
    """With weights_out the step is unchanged (param and states bit-identical to a step without
    it, and within the float64 reference's bound) and weights_out holds the updated param as
    Tensor.to casts it, bit for bit, for every weights and grad dtype."""
    adam_config = {"weight_decay": 0.1, "amsgrad": True}
    sgd_config = {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    for weights_dtype in WEIGHTS_DTYPES:
        for grad_dtype in GRAD_DTYPES:
            for n, offset, weights_offset in WEIGHTS_CASES:
                what = f"weights {weights_dtype} grad {grad_dtype} n {n} offset {offset}/{weights_offset}"
                param = _wide_param(n, offset, device, seed=n)
                grad = _step_buffer(n, offset, grad_dtype, device, seed=n + 1)
                adam_states = {
                    "param": param,
                    "exp_avg": _step_buffer(n, offset, torch.float32, device, seed=n + 2).mul_(0.1),
                    "exp_avg_sq": _step_buffer(n, offset, torch.float32, device, seed=n + 3).square_().mul_(0.01),
                    "max_exp_avg_sq": _step_buffer(n, offset, torch.float32, device, seed=n + 4).square_().mul_(0.02),
                }
                sgd_states = {"param": param.clone(), "momentum_buffer": _step_buffer(n, offset, torch.float32, device, seed=n + 5)}
                for op, states in (("adam", adam_states), ("sgd", sgd_states)):
                    without = {name: t.clone() for name, t in states.items()}
                    weights_out = _step_buffer(n, weights_offset, weights_dtype, device, seed=n + 6)
                    if op == "adam":
                        expected = _adam_reference(states["param"], grad, states["exp_avg"], states["exp_avg_sq"], states["max_exp_avg_sq"], 3, lr=1e-6, **adam_config)
                        for buffers, out in ((without, None), (states, weights_out)):
                            _ops.adam_step_(buffers["param"], grad, buffers["exp_avg"], buffers["exp_avg_sq"], step=3, lr=1e-6, max_exp_avg_sq=buffers["max_exp_avg_sq"], weights_out=out, **adam_config)
                    else:
                        expected = _sgd_reference(states["param"], grad, states["momentum_buffer"], False, lr=1e-6, **sgd_config)
                        for buffers, out in ((without, None), (states, weights_out)):
                            _ops.sgd_step_(buffers["param"], grad, buffers["momentum_buffer"], lr=1e-6, weights_out=out, **sgd_config)
                    for name, state in states.items():
                        _assert_bit_identical(state, without[name], f"{op} {what} {name} with weights_out vs without")
                        _assert_within(state, expected[name], f"{op} {what} {name}")
                    _assert_cast_like_tensor_to(weights_out, states["param"], f"{op} {what} weights_out")


# fp32 values whose casts are edge cases: ties (bf16 at 1 + 2^-8, fp16 at 1 + 2^-11, each
# rounding to the even neighbour, down and up), fp16's largest finite, its overflow threshold and
# beyond, fp16 subnormals and a tie to zero, an fp32 subnormal, fp32's largest (inf in bf16),
# signed zeros, infinities and NaN.
SPECIAL_VALUES = [
    1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8),
    1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), -(1 + 3 * 2**-11),
    65504.0, 65519.0, 65520.0, 1e6, -1e6,
    2**-20, 3 * 2**-25, 2**-25, -(2**-26), 2**-130, 3.4028234663852886e38,
    0.0, -0.0, float("inf"), float("-inf"), float("nan"),
]


def check_weights_out_rounds_edge_cases_like_tensor_to(device: str) -> None:
    """A step with lr 0 and a zero gradient leaves param as it is, so weights_out is param's cast:
    the edge values of SPECIAL_VALUES, tiled over full vectors, partial ones and thread splits."""
    n = 2**17 + 5
    values = torch.tensor(SPECIAL_VALUES, dtype=torch.float32)
    param = values.repeat(n // len(SPECIAL_VALUES) + 1)[:n].to(device)
    for weights_dtype in WEIGHTS_DTYPES:
        for op in ("adam", "sgd"):
            weights_out = torch.empty(n, dtype=weights_dtype, device=device)
            stepped, grad = param.clone(), torch.zeros(n, device=device)
            if op == "adam":
                _ops.adam_step_(stepped, grad, torch.zeros_like(stepped), torch.zeros_like(stepped), step=1, lr=0.0, weights_out=weights_out)
            else:
                _ops.sgd_step_(stepped, grad, lr=0.0, weights_out=weights_out)
            # x - 0 on a GPU may give a NaN the canonical payload.
            _assert_identical_but_nan_payloads(stepped, param, f"{op} lr 0 param")
            _assert_cast_like_tensor_to(weights_out, param, f"{op} {weights_dtype} weights_out")


# Parameters of a small model, flattened into one buffer for the ops; the last spans several CPU
# tasks, so thread splits fall inside it.
PARITY_SHAPES = [(37, 13), (129,), (7,), (2**17 + 5,)]
PARITY_STEPS = 5


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 spacing at |x|, in float64."""
    magnitude = x.float().abs()
    return (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).double()


def _assert_ulps(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, ulps: int, what: str) -> None:
    """|got - expected| <= ulps float32 ulps of |scale|."""
    err = (got.double() - expected.double()).abs() / _ulp(scale)
    worst = int(err.argmax())
    assert err[worst] <= ulps, f"{what}: element {worst} got {got[worst].item()}, torch {expected[worst].item()}: {err[worst].item():g} ulps > {ulps}"


def _parity_setup(device: str, grad_dtype: torch.dtype) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).to(device) for shape in PARITY_SHAPES]
    grads = [[torch.randn(shape, generator=generator).to(grad_dtype).to(device) for shape in PARITY_SHAPES] for _ in range(PARITY_STEPS)]
    return params, grads


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def check_adam_step_follows_torch_adam(device: str) -> None:
    """Step by step from torch.optim.Adam's (AdamW's) state, on the same gradients; torch sees a
    low-precision gradient upcast. On the CPU the states come out bit-identical (measured). The
    parameter differs where ATen's CPU sqrt (MKL's, one ulp off in about a fifth of its results)
    differs from the op's correctly rounded one: that ulp carries through the division by
    sqrt(1 - beta2^t), the eps add and the update's division (at most one more ulp each) into the
    update, and the final add rounds once: 4 ulps of the larger of parameter and update (measured:
    3). On CUDA both sides round sqrt correctly; the states are allowed one ulp until measured."""
    state_ulps = 0 if torch.device(device).type == "cpu" else 1
    for grad_dtype in GRAD_DTYPES:
        initial, grads = _parity_setup(device, grad_dtype)
        for config in ADAM_CONFIGS:
            params = [p.clone().requires_grad_() for p in initial]
            decoupled = config.get("decoupled_weight_decay", False)
            torch_config = {k: v for k, v in config.items() if k != "decoupled_weight_decay"}
            optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, lr=0.01, **torch_config)
            param = _flat(params)
            state_names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if config.get("amsgrad") else [])
            states = {name: torch.zeros_like(param) for name in state_names}
            for step, step_grads in enumerate(grads, start=1):
                before = _flat(params)
                for p, g in zip(params, step_grads):
                    p.grad = g.float()
                optimizer.step()
                _ops.adam_step_(param, _flat(step_grads), states["exp_avg"], states["exp_avg_sq"], step=step, lr=0.01, max_exp_avg_sq=states.get("max_exp_avg_sq"), **config)
                expected = _flat(params)
                what = f"adam {config} grad {grad_dtype} step {step}"
                for name, state in states.items():
                    torch_state = _flat([optimizer.state[p][name] for p in params])
                    _assert_ulps(state, torch_state, torch_state, state_ulps, f"{what} {name}")
                    state.copy_(torch_state)
                _assert_ulps(param, expected, torch.maximum(expected.abs(), (expected - before).abs()), 4, f"{what} param")
                param.copy_(expected)


def check_sgd_step_follows_torch_sgd(device: str) -> None:
    """Step by step from torch.optim.SGD's state, on the same gradients: bit-identical on the CPU
    (measured, ATen's default and AVX2/AVX512 kernels alike); one ulp allowed on CUDA until measured."""
    ulps = 0 if torch.device(device).type == "cpu" else 1
    for grad_dtype in GRAD_DTYPES:
        initial, grads = _parity_setup(device, grad_dtype)
        for config in SGD_CONFIGS:
            params = [p.clone().requires_grad_() for p in initial]
            optimizer = torch.optim.SGD(params, lr=0.1, **config)
            param = _flat(params)
            # NaN: the first step must overwrite the buffer, never read it.
            buffer = torch.full_like(param, float("nan")) if config.get("momentum") else None
            for step, step_grads in enumerate(grads, start=1):
                for p, g in zip(params, step_grads):
                    p.grad = g.float()
                optimizer.step()
                _ops.sgd_step_(param, _flat(step_grads), buffer, lr=0.1, first_step=step == 1, **config)
                expected = _flat(params)
                what = f"sgd {config} grad {grad_dtype} step {step}"
                _assert_ulps(param, expected, expected, ulps, f"{what} param")
                param.copy_(expected)
                if buffer is not None:
                    torch_buffer = _flat([optimizer.state[p]["momentum_buffer"] for p in params])
                    _assert_ulps(buffer, torch_buffer, torch_buffer, ulps, f"{what} momentum_buffer")
                    buffer.copy_(torch_buffer)


def _expect_error(fn, message: str) -> None:
    try:
        fn()
    except RuntimeError as error:
        assert message in str(error), f"{message!r} not in {str(error)!r}"
    else:
        raise AssertionError(f"expected an error saying {message!r}")


def check_optimizer_steps_reject_bad_input(device: str) -> None:
    def adam(param, grad, exp_avg, exp_avg_sq, **kwargs):
        return lambda: _ops.adam_step_(param, grad, exp_avg, exp_avg_sq, **{"step": 1, **kwargs})

    # Nonzero contents, so that a step would change them.
    p, g, m, v = (_random(8, torch.float32, device, seed) for seed in range(4))
    out = torch.full((8,), 7.0, dtype=torch.bfloat16, device=device)
    long_out, strided_out = torch.full((9,), 7.0, device=device), torch.full((16,), 7.0, dtype=torch.float16, device=device)
    before = [t.clone() for t in (p, g, m, v, out, long_out, strided_out)]
    cases = [
        (adam(p.bfloat16(), g, m, v), "adam_step_: param must be float32 (the fp32 main weights), got BFloat16"),
        (adam(p, g.double(), m, v), "adam_step_: grad must be float32, bfloat16 or float16, got Double"),
        (adam(p, g, m.half(), v), "adam_step_: exp_avg must be float32 like param, got Half"),
        (adam(p, g, m, torch.zeros(9, device=device)), "adam_step_: exp_avg_sq has 9 elements but param has 8; every buffer must cover the same elements"),
        (adam(p, torch.zeros(16, device=device)[::2], m, v), "adam_step_: grad must be a contiguous 1-D tensor (a flat buffer)"),
        (adam(p.view(2, 4), g, m, v), "adam_step_: param must be a contiguous 1-D tensor (a flat buffer), got shape [2, 4]"),
        (adam(p, g, m, v, step=0), "adam_step_: step must be >= 1"),
        (adam(p, g, m, v, amsgrad=True), "adam_step_: amsgrad=True needs max_exp_avg_sq"),
        (adam(p, g, m, v, max_exp_avg_sq=torch.zeros(8, device=device)), "adam_step_: max_exp_avg_sq is only read with amsgrad=True"),
        (adam(p, g, m, v, betas=(1.0, 0.999)), "adam_step_: beta1 must be in [0, 1), got 1"),
        (adam(p, g, m, v, lr=-1.0), "adam_step_: lr must be >= 0, got -1"),
        (adam(p, g, m, m), "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location"),
        (lambda: _ops.sgd_step_(p, g, lr=0.1, momentum=0.9), "sgd_step_: momentum=0.9 needs momentum_buffer"),
        (lambda: _ops.sgd_step_(p, g, m, lr=0.1), "sgd_step_: momentum_buffer is only used with momentum != 0"),
        (lambda: _ops.sgd_step_(p, g, m, momentum=0.9, dampening=0.1, nesterov=True), "sgd_step_: nesterov=True needs momentum > 0 and dampening == 0"),
        (lambda: _ops.sgd_step_(p, g.double()), "sgd_step_: grad must be float32, bfloat16 or float16, got Double"),
        (lambda: _ops.sgd_step_(p, torch.zeros(7, device=device)), "sgd_step_: grad has 7 elements but param has 8"),
        (adam(p, g, m, v, weights_out=out.double()), "adam_step_: weights_out must be float32, bfloat16 or float16 (the dtype the updated param is written in), got Double"),
        (adam(p, g, m, v, weights_out=long_out), "adam_step_: weights_out has 9 elements but param has 8; every buffer must cover the same elements"),
        (adam(p, g, m, v, weights_out=strided_out[::2]), "adam_step_: weights_out must be a contiguous 1-D tensor (a flat buffer), got shape [8] and strides [2]"),
        (adam(p, g, m, v, weights_out=out.view(2, 4)), "adam_step_: weights_out must be a contiguous 1-D tensor (a flat buffer), got shape [2, 4]"),
        (adam(p, g, m, v, weights_out=m), "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location"),
        (lambda: _ops.sgd_step_(p, g, lr=0.1, weights_out=out.int()), "sgd_step_: weights_out must be float32, bfloat16 or float16 (the dtype the updated param is written in), got Int"),
        (lambda: _ops.sgd_step_(p, g, lr=0.1, weights_out=long_out), "sgd_step_: weights_out has 9 elements but param has 8"),
        (lambda: _ops.sgd_step_(p, g, lr=0.1, weights_out=strided_out[::2]), "sgd_step_: weights_out must be a contiguous 1-D tensor (a flat buffer)"),
        (lambda: _ops.sgd_step_(p, g, lr=0.1, weights_out=p), "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location"),
    ]
    if torch.device(device).type != "cpu":
        cases.append((adam(p, g.cpu(), m, v), "adam_step_: grad is on cpu but param is on"))
        cases.append((adam(p, g, m, v, weights_out=out.cpu()), "adam_step_: weights_out is on cpu but param is on"))
        cases.append((lambda: _ops.sgd_step_(p, g, lr=0.1, weights_out=out.cpu()), "sgd_step_: weights_out is on cpu but param is on"))
    for fn, message in cases:
        _expect_error(fn, message)
    # Every check runs before the kernel writes anything.
    for got, expected in zip((p, g, m, v, out, long_out, strided_out), before):
        _assert_bit_identical(got, expected, "a rejected step wrote into a buffer")
