"""The C++ op library: loads ``megatron_fsdp._C``, registers a fake kernel for every op and
offers small typed wrappers. Everything above this module calls the ops through here."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_fsdp import _C  # noqa: F401  (registers torch.ops.megatron_fsdp and the pool class)

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
    """``out (=|+=) scale * chunks.sum(0)``, summed in fp32 (fp64 for fp64 chunks)."""
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


def new_bucket_pool(double_buffer: bool = False) -> torch.ScriptObject:
    """A :class:`BucketPool` (see ``csrc/common/bucket_pool.h``) for temporary buckets."""
    return torch.classes.megatron_fsdp.BucketPool(double_buffer)


def has_cuda_kernels() -> bool:
    """Whether this build registered CUDA kernels (it did when built with a CUDA torch and nvcc)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("megatron_fsdp::flatten_copy", "CUDA")
