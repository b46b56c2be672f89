"""The one error offline conversion raises for bad input."""

from __future__ import annotations


class ConversionError(ValueError):
    """The input cannot be converted as asked: a directory that is not a checkpoint, a tensor the
    mapping does not know or that is missing, a shape that disagrees with the model's config. The
    message names the tensor or file and the fix; nothing was written to the output."""
