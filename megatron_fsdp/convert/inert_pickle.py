"""Megatron-LM's pickled state (``args``, the torch_dist common state) read and written again
without megatron-core and without running anything the files name.

Reading: torch's weights-only unpickler, with each class it does not allow replaced by an
:class:`Opaque` stand-in that keeps the constructor arguments and state as data (an enum of
megatron-core's in ``args``); ``argparse.Namespace``, ``types.SimpleNamespace`` and ``io.BytesIO``
are rebuilt as themselves. Writing: ``torch.save`` whose pickler names each stand-in's class by the original
module and name, so Megatron-LM unpickles what it wrote.
"""

from __future__ import annotations

import argparse
import io
import pickle
import types
from typing import IO, Any

import torch

from megatron_fsdp.convert.errors import ConversionError


class Opaque:
    """An object of a class a checkpoint names and this process does not rebuild: its
    constructor arguments and state, as data; nothing of the class runs."""

    qualified_name = "?"
    args: tuple = ()
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> tuple:
        return (type(self), self.args) if self.state is None else (type(self), self.args, self.state)

    def __repr__(self) -> str:
        return f"Opaque({self.qualified_name}{self.args!r})"


# Plain containers of data, rebuilt as themselves (a pickled ``io.BytesIO``: bytes DCP's default
# planner pickled once more).
_REBUILT = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace, "_io.BytesIO": io.BytesIO}


def unpickle_inertly(data: bytes | str, what: str) -> Any:
    """A ``torch.save`` file (bytes, or a path) loaded with stand-ins for the classes it names."""

    def stream() -> IO[bytes] | str:
        return io.BytesIO(data) if isinstance(data, bytes) else data

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(stream())
    except Exception as error:  # noqa: BLE001 - a damaged file: say which
        raise ConversionError(f"{what} is not a file torch.save wrote ({error}): the checkpoint is damaged") from None
    stand_ins: list[Any] = []
    for name in names:
        if name in _REBUILT:
            stand_ins.append(_REBUILT[name])
        else:
            stand_ins.append((type(name.rsplit(".", 1)[-1], (Opaque,), {"qualified_name": name}), name))
    with torch.serialization.safe_globals(stand_ins):
        return torch.load(stream(), weights_only=True, map_location="cpu")


class _StandInPickler(pickle._Pickler):
    """Python's pickler that writes a stand-in class as the global it stands for."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Opaque) and obj is not Opaque:
            module, _, qualname = obj.qualified_name.rpartition(".")
            self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


_STAND_IN_PICKLE = types.ModuleType("stand_in_pickle")  # what torch.save takes as its pickle module
_STAND_IN_PICKLE.Pickler = _StandInPickler


def save_inertly(value: Any) -> bytes:
    """``torch.save(value)``, stand-ins written as the classes they stand for."""
    buffer = io.BytesIO()
    torch.save(value, buffer, pickle_module=_STAND_IN_PICKLE)
    return buffer.getvalue()
