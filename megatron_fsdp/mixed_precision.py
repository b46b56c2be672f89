"""The dtypes of main parameters, main gradients and gradient communication: upstream's
``MixedPrecisionPolicy``, and what it resolves to for one bucket."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes of the optimizer's main parameters, of the accumulated main gradients and of
    gradient communication. ``None`` means: main params / main grads in the model's compute
    dtype (the parameters' dtype), communication in the main-gradient dtype.

    When ``grad_comm_dtype`` is less precise than the main gradients, gradients travel in the
    communication dtype but are summed in the main-gradient dtype (an all-to-all followed by
    the ``promoting_reduce`` op) instead of by a low-precision reduce-scatter.
    """

    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be None or a float dtype (float32, bfloat16, float16, float64), got {value!r}")

    def resolve(self, compute_dtype: torch.dtype) -> ResolvedDtypes:
        main_grads = self.main_grads_dtype or compute_dtype
        return ResolvedDtypes(
            compute=compute_dtype,
            main_params=self.main_params_dtype or compute_dtype,
            main_grads=main_grads,
            comm=self.grad_comm_dtype or main_grads,
        )


@dataclass(frozen=True)
class ResolvedDtypes:
    """A bucket's dtypes once the policy meets its parameters' compute dtype."""

    compute: torch.dtype
    main_params: torch.dtype
    main_grads: torch.dtype
    comm: torch.dtype

    @property
    def promotes_reduction(self) -> bool:
        """Communication less precise than accumulation: sum received chunks in high precision."""
        return torch.finfo(self.comm).eps > torch.finfo(self.main_grads).eps

    @property
    def grads_below_main_params(self) -> bool:
        """Main gradients less precise than the main params (bf16 under fp32), not merely of
        another dtype: float64 main gradients under fp32 main params are not below them."""
        return torch.finfo(self.main_grads).eps > torch.finfo(self.main_params).eps
