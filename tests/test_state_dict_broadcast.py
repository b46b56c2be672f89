"""torch's rank-0 broadcast into megatron_fsdp's DTensors with nothing of torch patched: importing
megatron_fsdp leaves every torch module as it was (checked in a fresh interpreter), and
set_model_state_dict / set_optimizer_state_dict with ``broadcast_from_rank0=True`` load a
single-process model's full state, which rank 0 alone holds, bit for bit into 2 gloo ranks whose
flat pieces start and end inside rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import megatron_fsdp
from _dist import run_distributed
from models import Block, make_batch, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prints the torch modules that importing megatron_fsdp loads.
_LIST_TORCH_MODULES = """
import json, sys
import megatron_fsdp
print(json.dumps(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))))
"""

# Loads those modules first (torch's own imports rebind a few of its attributes, e.g. when
# torch.distributed.tensor registers its safe globals), then prints every attribute of a torch
# module, or of a class defined in one, that importing megatron_fsdp rebinds or removes.
_CHANGED_BY_IMPORT = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)

def namespaces():
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch" or name.startswith("torch.")):
            continue
        yield name, module
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                yield f"{name}.{attr}", value

before = {name: (owner, dict(vars(owner))) for name, owner in namespaces()}
import megatron_fsdp
missing = object()
print(json.dumps(sorted(
    f"{name}.{attr}"
    for name, (owner, attrs) in before.items()
    for attr, value in attrs.items()
    if vars(owner).get(attr, missing) is not value
)))
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_importing_megatron_fsdp_changes_nothing_in_torch() -> None:
    loaded = _python(_LIST_TORCH_MODULES)
    changed = json.loads(_python(_CHANGED_BY_IMPORT, loaded))
    assert changed == [], f"import megatron_fsdp replaced these torch attributes: {changed}"


def _cut_inside_a_row(value: torch.Tensor) -> bool:
    """Whether this rank's flat piece of ``value`` starts or ends inside a row (torch.chunk rows
    could then never describe it)."""
    layout = getattr(value, "_flat_layout", None)
    if layout is None or len(layout.local_shape) < 2:
        return False
    start, length = layout.mine(value.device_mesh)
    row = math.prod(layout.local_shape[1:])
    return length > 0 and (start % row != 0 or (start + length) % row != 0)


def _full_optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """FQN -> state name -> full value, gathered from the optimizer's own state."""
    names = {face: name for name, face in model.named_parameters()}
    return {
        names[face]: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in optimizer.state[face].items()}
        for group in optimizer.param_groups
        for face in group["params"]
    }


def _mismatches(got: dict, expected: dict, what: str) -> list[str]:
    found = [f"{what} {key} missing" for key in expected if key not in got]
    for key in got.keys() & expected.keys():
        a, b = got[key], expected[key]
        if isinstance(b, dict):
            found += _mismatches(a, b, f"{what} {key}")
        elif not (a.shape == b.shape and torch.equal(a.cpu(), b.cpu())):
            error = (a.cpu().double() - b.cpu().double()).abs().max().item() if a.shape == b.shape else "shape"
            found.append(f"{what} {key} (max error {error})")
    return found


def _load_by_rank0_broadcast(rank: int, world: int, strategy: int) -> dict:
    """A single-process model and AdamW after one step (every rank builds the same), then a
    sharded model that trained on other data loads rank 0's copy of their full state through
    torch's broadcast; returns what differs and which pieces start or end inside a row."""
    reference = make_model(seed=3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    reference(*make_batch(0, 2 * world)).backward()
    reference_optimizer.step()
    full_options = StateDictOptions(full_state_dict=True)
    reference_optimizer_state = get_optimizer_state_dict(reference, reference_optimizer, options=full_options)

    module = make_model(seed=0)
    model, optimizer = megatron_fsdp.fully_shard(
        module,
        torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )
    tokens, targets = make_batch(7, 2 * world)
    model(tokens[rank::world], targets[rank::world]).backward()
    optimizer.step()
    optimizer.zero_grad()

    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # torch writes into the dicts it is given: rank 0 hands over copies.
    model_state = {k: v.detach().clone() for k, v in reference.state_dict().items()} if rank == 0 else {}
    set_model_state_dict(model, model_state, options=broadcast)
    optimizer_state = {
        "state": {n: {k: v.clone() for k, v in e.items()} for n, e in reference_optimizer_state["state"].items()},
        "param_groups": [dict(g) for g in reference_optimizer_state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, optimizer_state if rank == 0 else {}, options=broadcast)

    expected_parameters = {name: param.detach() for name, param in reference.named_parameters()}
    return {
        "mismatches": _mismatches(model.full_parameters(), expected_parameters, "parameter")
        + _mismatches(_full_optimizer_state(model, optimizer), reference_optimizer_state["state"], "optimizer state"),
        "cut inside a row": sorted(name for name, face in model.named_parameters() if _cut_inside_a_row(face)),
    }


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_rank0_broadcast_loads_a_single_process_state_exactly(strategy: int) -> None:
    per_rank = run_distributed(_load_by_rank0_broadcast, 2, strategy)
    for rank, result in enumerate(per_rank):
        assert result["mismatches"] == [], f"strategy {strategy} rank {rank}: {result['mismatches']}"
    if strategy != 0:  # no_shard holds whole parameters
        cut = [name for result in per_rank for name in result["cut inside a row"]]
        assert cut, f"strategy {strategy}: no flat piece starts or ends inside a row, so rows would have sufficed"
