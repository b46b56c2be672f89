"""Every tensor of a Hugging Face model directory, read with safetensors itself (not the code under test)."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open


def read_safetensors_dir(directory: str) -> dict[str, torch.Tensor]:
    found = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as handle:
                found.update({key: handle.get_tensor(key) for key in handle.keys()})
    return found
