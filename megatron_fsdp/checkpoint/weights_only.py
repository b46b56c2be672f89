"""Unpickling what a checkpoint holds without running code that came with it.

Unpickling calls whatever functions the pickle names, so a checkpoint from a stranger can run
anything on ``torch.load(..., weights_only=False)``. torch's weights-only unpickler builds only
tensors, numbers, strings, containers, dtypes, devices and the classes a process allowed with
``torch.serialization.add_safe_globals``. We add numpy's arrays, scalars and dtypes (numpy's
RNG state is a tuple holding an array): rebuilding them runs no code a pickle chooses. What else
a checkpoint names is refused with :class:`UnsafeCheckpointError`, naming its types and the
line that allows them; saving refuses it up front, so that a save never writes what a load
would refuse.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from functools import cache
from typing import IO, Any

import torch


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds an object that cannot be unpickled without running code the file
    chooses (a class that torch's weights-only unpickler does not allow, or a ``.metadata`` that
    names more than DCP's metadata classes). Nothing of it was run. Raised on every rank alike
    by ``load_checkpoint``, before anything was read into the model or the optimizer.

    Attribute ``refused``: the refused globals as ``module.name`` (empty where unknown)."""

    def __init__(self, message: str, refused: list[str] | None = None) -> None:
        super().__init__(message)
        self.refused = refused or []


@cache
def _numpy_globals() -> tuple[Callable[..., Any] | tuple[Callable[..., Any], str], ...]:
    """What numpy arrays, scalars and dtypes of numbers and bools pickle as, under numpy 2's
    module path and numpy 1's (the one a checkpoint saved with numpy 1 names). Object arrays
    stay refused."""
    try:
        import numpy
    except ImportError:
        return ()
    multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray
    dtype_classes = {type(numpy.dtype(code)) for code in "?bhilqBHILQefdgFDG"}
    found: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [numpy.ndarray, numpy.dtype, *dtype_classes]
    for function in (multiarray._reconstruct, multiarray.scalar):
        found += [(function, f"numpy._core.multiarray.{function.__name__}"), (function, f"numpy.core.multiarray.{function.__name__}")]
    return tuple(found)


def _unsafe_globals(pickled: bytes) -> list[str]:
    """The globals a ``torch.save`` file names that weights-only loading does not allow; read
    from the pickle without running it. Empty when it cannot tell."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(pickled))
    except Exception:  # noqa: BLE001 - damaged bytes: the caller reports torch's own error
        return []


def _allow_line(names: list[str]) -> str:
    return f"torch.serialization.add_safe_globals([{', '.join(names)}])"


def load_weights_only(source: str | IO[bytes], what: str, **load_args: Any) -> Any:
    """``torch.load(source, weights_only=True, **load_args)`` that also loads numpy arrays, and
    raises :class:`UnsafeCheckpointError` naming ``what`` (which file or item), the refused types
    and the line that allows them, when the file names anything else."""
    allowed = torch.serialization.get_safe_globals()
    # Only those not allowed already: leaving the context removes what it added.
    with torch.serialization.safe_globals([g for g in _numpy_globals() if g not in allowed]):
        try:
            return torch.load(source, weights_only=True, **load_args)
        except pickle.UnpicklingError as error:
            refusal = str(error).strip().splitlines()[-1]
            if isinstance(source, str):
                with open(source, "rb") as handle:
                    pickled = handle.read()
            else:
                source.seek(0)
                pickled = source.read()
            names = _unsafe_globals(pickled)
    if not names:
        raise UnsafeCheckpointError(
            f"{what} holds an object that cannot be unpickled without running code that came with it "
            f"(torch's weights-only unpickler refused it: {refusal}); nothing of it was run"
        ) from None
    raise UnsafeCheckpointError(
        f"{what} refers to {names}, which loading does not unpickle: unpickling them could run code "
        f"that came with the checkpoint (nothing of it was run). If you trust this checkpoint and these classes, "
        f"allow them before loading, on every rank: {_allow_line(names)}",
        names,
    ) from None


def serialize_weights_only(value: Any, what: str) -> bytes:
    """``value`` as ``torch.save`` writes it, after checking that :func:`load_weights_only`
    reads it back; raises ``ValueError`` naming ``what``, the types it would refuse and how to
    save them instead."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    pickled = buffer.getvalue()
    try:
        load_weights_only(io.BytesIO(pickled), what)
    except UnsafeCheckpointError as error:
        names = error.refused or ["an object weights-only loading refuses"]
        raise ValueError(
            f"{what} refers to {names}, which load_checkpoint would refuse to unpickle (unpickling "
            f"them could run code that came with a checkpoint). Save their state_dict() or plain numbers, "
            f"strings, lists, dicts, tensors and numpy arrays instead; or, for a class safe to rebuild from a "
            f"stranger's checkpoint, run {_allow_line(names)} before saving and before every load"
        ) from None
    return pickled
