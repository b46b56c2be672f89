"""The C++ op library: loads ``megatron_fsdp._C``, registers a fake kernel for every op and
offers small typed wrappers. Everything above this module calls the ops through here."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._guards import detect_fake_mode

from megatron_fsdp import _C  # noqa: F401  (registers torch.ops.megatron_fsdp and the pool class)

from megatron_fsdp._fake_bucket_pool import FakeBucketPool

_ops = torch.ops.megatron_fsdp


@torch.library.register_fake("megatron_fsdp::param_views")
def _param_views_fake(flat, offsets, shapes, ranks):
    views, cursor = [], 0
    for offset, rank in zip(offsets, ranks):
        shape = list(shapes[cursor : cursor + rank])
        cursor += rank
        numel = 1
        for size in shape:
            numel *= size
        views.append(flat.narrow(0, offset, numel).view(shape))
    return views


@torch.library.register_fake("megatron_fsdp::flatten_copy")
def _flatten_copy_fake(srcs, offsets, flat):
    return None


@torch.library.register_fake("megatron_fsdp::unflatten_copy")
def _unflatten_copy_fake(flat, offsets, dsts):
    return None


@torch.library.register_fake("megatron_fsdp::promoting_reduce")
def _promoting_reduce_fake(chunks, scale, accumulate, out):
    return None


@torch.library.register_fake("megatron_fsdp::find_non_finite")
def _find_non_finite_fake(tensors):
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty(len(tensors), dtype=torch.bool, device=device)


@torch.library.register_fake("megatron_fsdp::multi_tensor_norm")
def _multi_tensor_norm_fake(tensors, norm_type):
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty(len(tensors), dtype=torch.float32, device=device)


@torch.library.register_fake("megatron_fsdp::crc32c")
def _crc32c_fake(data, seed):
    return torch.empty((), dtype=torch.int64, device=data.device)


@torch.library.register_fake("megatron_fsdp::adam_step_")
def _adam_step_fake(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, decoupled_weight_decay, amsgrad, maximize, weights_out=None):
    return None


@torch.library.register_fake("megatron_fsdp::sgd_step_")
def _sgd_step_fake(param, grad, momentum_buffer, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step, weights_out=None):
    return None


@torch.library.register_fake("megatron_fsdp::segment_amax")
def _segment_amax_fake(flat, bounds):
    return torch.empty(len(bounds) // 2, dtype=torch.float32, device=flat.device)


@torch.library.register_fake("megatron_fsdp::float8_cast_segments")
def _float8_cast_segments_fake(flat, bounds, scales, out):
    return None


def param_views(flat: torch.Tensor, offsets: Sequence[int], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``shapes`` starting at ``offsets`` (elements); no copy."""
    flat_shapes = [size for shape in shapes for size in shape]
    return _ops.param_views(flat, list(offsets), flat_shapes, [len(shape) for shape in shapes])


def flatten_copy(srcs: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> None:
    """Copies each source into ``flat`` at its offset, cast to ``flat``'s dtype."""
    _ops.flatten_copy(list(srcs), list(offsets), flat)


def unflatten_copy(flat: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
    """Copies ``flat[offset : offset + dst.numel()]`` into each destination, cast to its dtype."""
    _ops.unflatten_copy(flat, list(offsets), list(dsts))


def promoting_reduce(chunks: torch.Tensor, out: torch.Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
    """``out (=|+=) scale * chunks.sum(0)``, summed in fp32 (fp64 when chunks or out are fp64)."""
    _ops.promoting_reduce(chunks, float(scale), bool(accumulate), out)


def find_non_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A bool per tensor, on the tensors' device: does it hold a NaN or an Inf."""
    if not tensors:  # no tensor argument: the dispatcher would have no device to pick a kernel by
        return torch.zeros(0, dtype=torch.bool)
    return _ops.find_non_finite(list(tensors))


def multi_tensor_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Per tensor, ``sum(|x| ** norm_type)`` (the p-th power of the p-norm, not rooted), or
    ``max(|x|)`` for ``norm_type=math.inf`` (0 for an empty tensor), as a float32 tensor on the
    tensors' device, without a host sync.

    ``tensors``: contiguous float32, float64, float16 or bfloat16 tensors, mixed freely, all on one
    device. ``norm_type``: any value > 0 or ``inf`` (default 2.0: the sum of squares). Sums are
    accumulated in float64, so each entry is within a few float32 ulps of the exact value. A NaN in
    a tensor makes its entry NaN and an Inf makes it Inf, so callers can report non-finite norms;
    a finite sum beyond the float32 range is Inf as well.
    """
    if not tensors:  # no tensor argument: the dispatcher would have no device to pick a kernel by
        return torch.zeros(0, dtype=torch.float32)
    return _ops.multi_tensor_norm(list(tensors), float(norm_type))


def crc32c(data: torch.Tensor, seed: int = 0) -> int:
    """The CRC-32C (Castagnoli; the checksum of iSCSI and ext4) of ``data``'s bytes: a contiguous
    uint8 CPU tensor. ``seed`` (default 0) continues a running CRC: ``crc32c(b, crc32c(a))`` is
    the CRC of ``a`` followed by ``b``. Multi-threaded over inputs of several MiB."""
    return int(_ops.crc32c(data, int(seed)))


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    amsgrad: bool = False,
    max_exp_avg_sq: torch.Tensor | None = None,
    maximize: bool = False,
    weights_out: torch.Tensor | None = None,
) -> None:
    """One ``torch.optim.Adam`` step (``AdamW``'s with ``decoupled_weight_decay=True``) over flat
    buffers, in place: updates ``param``, ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq``, and
    writes the updated ``param`` into ``weights_out`` when given.

    ``param``, ``exp_avg``, ``exp_avg_sq``: contiguous 1-D float32 tensors of one size on one device
    (CPU or CUDA), not sharing memory; the states start at zero, as torch.optim's. ``grad``: the
    same size, float32, bfloat16 or float16 (upcast to float32 first). ``step``: the step count
    including this step, >= 1 (torch.optim's ``state['step']`` after its increment). ``lr``
    (default 1e-3), ``betas`` (default (0.9, 0.999), each in [0, 1)), ``eps`` (1e-8) and
    ``weight_decay`` (0.0): torch.optim.Adam's hyperparameters and rules. ``amsgrad`` (False) needs
    ``max_exp_avg_sq``, a float32 buffer like ``exp_avg_sq`` starting at zero, given only then.
    ``maximize`` (False) ascends the gradient. ``weights_out`` (None): a contiguous 1-D float32,
    bfloat16 or float16 tensor of ``param``'s size on its device, not sharing memory with the
    other buffers; it receives the updated ``param`` cast exactly as ``param.to(weights_out.dtype)``
    would (round to nearest even), in the same pass over memory as the step: the compute weights
    of a mixed-precision model without reading the main weights again.

    The CPU kernel follows torch.optim's single-tensor update operation by operation and runs on
    ``torch.get_num_threads()`` threads; the CUDA kernel follows torch's default (foreach) path on
    CUDA. On the CPU, from the same inputs, the states come out bit-identical to
    torch.optim.Adam's and ``param`` within 4 float32 ulps of the larger of the new parameter and
    its update (3 measured): ATen's CPU ``sqrt`` (MKL's) is one ulp off in about a fifth of its
    results, where this op's is correctly rounded.
    """
    beta1, beta2 = betas
    _ops.adam_step_(
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), int(step), bool(decoupled_weight_decay), bool(amsgrad), bool(maximize), weights_out,
    )


def sgd_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool = False,
    weights_out: torch.Tensor | None = None,
) -> None:
    """One ``torch.optim.SGD`` step over flat buffers, in place: updates ``param`` and
    ``momentum_buffer``, and writes the updated ``param`` into ``weights_out`` when given.

    ``param``: a contiguous 1-D float32 tensor on the CPU or a GPU; ``grad``: the same size, float32,
    bfloat16 or float16 (upcast to float32 first). ``momentum_buffer``: a float32 buffer like
    ``param``, given exactly when ``momentum != 0``. ``first_step`` (False): the buffer holds no
    history yet and is set to the gradient, whatever it held (torch's rule for a parameter without
    momentum state); pass True on the first step. ``lr`` (default 1e-3), ``momentum`` (0.0),
    ``dampening`` (0.0), ``weight_decay`` (0.0), ``nesterov`` (False, needs momentum > 0 and
    dampening 0) and ``maximize`` (False): torch.optim.SGD's hyperparameters and rules.
    ``weights_out`` (None): as for :func:`adam_step_`, the updated ``param`` cast. On the CPU,
    from the same inputs, the results are bit-identical to torch.optim.SGD's; the CUDA kernel
    follows torch's default (foreach) path on CUDA.
    """
    _ops.sgd_step_(
        param, grad, momentum_buffer, float(lr), float(momentum), float(dampening), float(weight_decay),
        bool(nesterov), bool(maximize), bool(first_step), weights_out,
    )


def segment_amax(flat: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """``max(|flat[start:end]|)`` for each ``(start, end)`` pair of ``bounds`` (a flat list), as a
    float32 tensor on ``flat``'s device (0 for an empty segment, NaN where one holds a NaN).
    ``flat``: a contiguous 1-D float32, float64, float16 or bfloat16 tensor."""
    return _ops.segment_amax(flat, list(bounds))


def float8_cast_segments(
    flat: torch.Tensor, bounds: Sequence[int], scales: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[i] = float8(clamp(flat[i] * scales[s], -max, max))`` for ``i`` in segment ``s`` (the
    ``(start, end)`` pairs of ``bounds``), 0 elsewhere: torchao's tensorwise weight cast, the
    product taken in float32, rounded to nearest even, ``max`` the largest finite value of
    ``out``'s format (float8_e4m3fn or float8_e5m2). ``scales``: float32, one per segment;
    ``out``: contiguous, as many elements as ``flat``, on its device."""
    _ops.float8_cast_segments(flat, list(bounds), scales, out)


def new_bucket_pool(double_buffer: bool = False) -> torch.ScriptObject | FakeBucketPool:
    """A :class:`BucketPool` (see ``csrc/common/bucket_pool.h``) for temporary buckets; under
    ``FakeTensorMode`` (a simulated rank) its fake counterpart, which lends fake memory."""
    fake_mode = detect_fake_mode()
    if fake_mode is not None:
        return FakeBucketPool(double_buffer, fake_mode)
    return torch.classes.megatron_fsdp.BucketPool(double_buffer)


def has_cuda_kernels() -> bool:
    """Whether this build registered CUDA kernels (it did when built with a CUDA torch and nvcc)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("megatron_fsdp::flatten_copy", "CUDA")
