"""Every error of docs/troubleshooting.md that no other test raises: each is triggered the way
the table says and must carry the message the table quotes. The last test checks that the
table's test column names tests that exist."""

from __future__ import annotations

import ast
import functools
import os
import re

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import OffloadPolicy

import megatron_fsdp
from megatron_fsdp.integrations.megatron_lm import args_from_ddp_config
from models import Block, make_batch, make_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sharded(**kwargs):
    model = make_model()
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters()), fsdp_unit_modules=[Block], **kwargs)


SETUP_ERRORS = {
    "unit entry of another type": (dict(fsdp_unit_modules=[42]), ValueError, "neither a class nor an import path"),
    "unit path to a function": (dict(fsdp_unit_modules=["models.make_model"]), ValueError, "'models.make_model' is not a class"),
    "unit list that is a class": (dict(fsdp_unit_modules=Block), TypeError, "fsdp_unit_modules must be a list"),
    "meta init of a real model": (dict(init_model_with_meta_device=True), ValueError, "none of its parameters is on the meta device"),
    "dim without a mesh": (dict(dp_shard_dim="dp"), ValueError, "dp_shard_dim='dp' was given without a device_mesh"),
    "outer dim without a mesh": (dict(dp_outer_dim="dp_outer"), ValueError, "dp_outer_dim='dp_outer' needs a device_mesh"),
    "flag that is not a bool": (dict(overlap_grad_reduce="no"), TypeError, "overlap_grad_reduce must be True or False"),
    "nccl_ub that is not a bool": (dict(nccl_ub="yes"), TypeError, "nccl_ub must be True or False"),
    "deprecated flag that is not a bool": (dict(grad_reduce_in_fp32=1), TypeError, "grad_reduce_in_fp32 must be None, True or False"),
    "mesh of another type": (dict(device_mesh="cpu"), TypeError, "device_mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    "dim name of another type": (dict(tp_dim=0), TypeError, "tp_dim must be the name of a mesh dim"),
    "policy of another type": (dict(mixed_precision_policy="bf16"), TypeError, "mixed_precision_policy must be a megatron_fsdp"),
    "tp dim without a mesh": (dict(tp_dim="tp"), ValueError, "tp_dim='tp' needs a device_mesh holding that dim"),
    "unknown device string": (dict(device="gpu0"), ValueError, "device='gpu0' is not a device torch knows"),
    "device of another type": (dict(device=1.5), TypeError, "device must be a torch.device"),
    "offload flag that is not a bool": (dict(cpu_offload="yes"), TypeError, "cpu_offload must be True or False"),
    "offload policy of another type": (dict(offload_policy=True), TypeError, "offload_policy must be torch.distributed.fsdp's"),
    "offload flag against a no-offload policy": (
        dict(cpu_offload=True, offload_policy=OffloadPolicy()), ValueError, "cpu_offload=True contradicts offload_policy=OffloadPolicy()",
    ),
}


@pytest.mark.parametrize("case", list(SETUP_ERRORS))
def test_setup_errors(case, single_rank_group) -> None:
    arguments, error, message = SETUP_ERRORS[case]
    with pytest.raises(error, match=re.escape(message)):
        megatron_fsdp.fully_shard_model(make_model(), **{"fsdp_unit_modules": [Block], **arguments})


def test_sharding_twice_is_refused(single_rank_group) -> None:
    model, _ = _sharded()
    with pytest.raises(ValueError, match="already sharded by megatron_fsdp"):
        megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block])


def test_a_multi_dim_mesh_needs_the_dim_named(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_shard"))
    with pytest.raises(ValueError, match="name the one to shard over with dp_shard_dim"):
        megatron_fsdp.fully_shard_model(make_model(), device_mesh=mesh, fsdp_unit_modules=[Block])


def test_meta_init_is_refused_with_expert_parallelism(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match="cannot be combined with tensor- or expert-parallel parameters"):
        megatron_fsdp.fully_shard_model(model, expt_device_mesh=mesh, fsdp_unit_modules=[Block],
                                        init_model_with_meta_device=True)


def test_optimizer_errors(single_rank_group) -> None:
    megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    with pytest.raises(ValueError, match="cannot tell which sharded model this optimizer belongs to"):
        megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(make_model().parameters()))
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    tokens, targets = make_batch(0, 2)
    model(tokens, targets).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already holds state"):
        megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Block])


def _during_backward(action) -> None:
    """Runs ``action(model, optimizer)`` from a gradient hook, i.e. while backward runs."""
    model, optimizer = _sharded()
    model.module.pos.register_hook(lambda grad: action(model, optimizer))
    tokens, targets = make_batch(0, 2)
    model(tokens, targets).backward()


MID_STEP_ERRORS = {
    "forward": (lambda m, o: m(*make_batch(0, 2)), "ran forward while a backward pass is in progress"),
    "optimizer step": (lambda m, o: o.step(), "optimizer.step() was called during forward or backward"),
    "finish_grad_sync": (lambda m, o: m.finish_grad_sync(), "finish_grad_sync() was called during forward or backward"),
    "policy change": (
        lambda m, o: setattr(m, "mixed_precision_policy", megatron_fsdp.MixedPrecisionPolicy()),
        "change the mixed-precision policy between steps",
    ),
    "state dict load": (lambda m, o: m.load_state_dict(m.state_dict()), "load a state dict between steps"),
}


@pytest.mark.parametrize("case", list(MID_STEP_ERRORS))
def test_mid_step_errors(case, single_rank_group) -> None:
    action, message = MID_STEP_ERRORS[case]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _during_backward(action)


def test_state_dict_errors(single_rank_group) -> None:
    model, optimizer = _sharded()
    with pytest.raises(ValueError, match="assign=True cannot apply"):
        model.load_state_dict(model.state_dict(), assign=True)
    with pytest.raises(RuntimeError, match="the model state dict does not fit this model.*unexpected: bogus"):
        model.load_state_dict(dict(model.state_dict(), bogus=torch.zeros(1)))
    state = optimizer.state_dict()
    state["state"]["bogus"] = {"step": torch.tensor(1.0)}
    with pytest.raises(RuntimeError, match="the optimizer state dict does not fit this model.*unexpected: bogus"):
        optimizer.load_state_dict(state)


def test_a_dtype_without_a_megatron_flag_is_named() -> None:
    config = megatron_fsdp.DistributedDataParallelConfig(megatron_fsdp_main_params_dtype=torch.float64)
    with pytest.raises(ValueError, match="has no Megatron-LM flag spelling"):
        args_from_ddp_config(config)


def test_the_troubleshooting_table_names_tests_that_exist() -> None:
    with open(os.path.join(REPO, "docs", "troubleshooting.md")) as handle:
        named = re.findall(r"`(test_\w+\.py)::(test_\w+)(?:\[[^\]]*\])?`", handle.read())
    assert len(named) > 40, "the table's test column is missing"
    missing = []
    for file, test in set(named):
        path = os.path.join(REPO, "tests", file)
        if not os.path.exists(path) or not re.search(rf"^def {test}\(", open(path).read(), re.MULTILINE):
            missing.append(f"{file}::{test}")
    assert not missing, f"docs/troubleshooting.md names tests that do not exist: {sorted(missing)}"



# What docs/troubleshooting.md's message column writes for the parts a real message fills in: a
# name or number (`X`, `N`, ... a capital letter alone, or PATH, FILE, DIR, ITEM) and "..." for
# text left out. Anything else in the column is quoted from the message.
PLACEHOLDER = re.compile(r"\b(?:[A-Z]|PATH|FILE|DIR|ITEM)\b")
COMPUTED = "\0"  # a computed part of a source string: an f-string's {...}, an operand of +
# A source string is a candidate for a quoted run when it holds at least half the run's words.
WORD = re.compile(r"[A-Za-z_][\w.]{3,}")
# At most this many characters (or a third of a quoted run, if more) may be values the table
# writes out where the message computes them (`device_mesh has N dims` for
# `{mesh_argument} has {ndim} dims`): enough for a name, too few to stand in for a clause.
MOST_FILLED = 16


def _package_strings() -> list[str]:
    """Every string literal of megatron_fsdp's source, each f-string's (and ``+`` chain's)
    computed parts as COMPUTED."""

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):
            return "".join(text(part) or COMPUTED for part in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = text(node.left), text(node.right)
            return None if left is None and right is None else (left or COMPUTED) + (right or COMPUTED)
        return None

    strings = []
    for where, _, names in os.walk(os.path.join(REPO, "megatron_fsdp")):
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(where, name)) as handle:
                strings += [s for s in map(text, ast.walk(ast.parse(handle.read()))) if s and s.strip(COMPUTED)]
    return strings


@functools.cache
def _positions(source: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Where ``source`` has computed parts (a mask, one longer than the source) and where each of
    its characters is."""
    codes = np.array([ord(c) for c in source] + [-1])
    return codes == ord(COMPUTED), {c: np.flatnonzero(codes == ord(c)) for c in set(source)}


def _fewest_filled(source: str, quoted: list[str | tuple[str]]) -> int | None:
    """The fewest characters of ``quoted`` (a run of the table's column: characters, and
    placeholders as 1-tuples of their text) that must fall in computed parts of ``source`` for
    some text the source produces to hold it; None if none does. A placeholder falls in a
    computed part, free, or is the source's own text (`N` in `pass --num-... N with N > 1`); a
    character matches the source's, or falls in a computed part (the table wrote out a value
    the message computes)."""
    computed, at = _positions(source)
    never = sum(len(t) if isinstance(t, str) else len(t[0]) for t in quoted) + 1
    # cost[j]: fewest filled characters with source[:j] matched; the quote may start anywhere
    cost = np.zeros(len(source) + 1, dtype=np.int64)

    def through_empty_computed(cost: np.ndarray) -> np.ndarray:
        for j in np.flatnonzero(computed):  # in order, so runs of computed parts pass through
            cost[j + 1] = min(cost[j + 1], cost[j])
        return cost

    cost = through_empty_computed(cost)
    for token in quoted:
        text = token if isinstance(token, str) else token[0]
        step = np.full_like(cost, never)
        starts = at.get(text)
        if starts is None:  # a placeholder's text
            starts = np.array([j for j in range(len(source)) if source.startswith(text, j)], dtype=np.int64)
        step[starts + len(text)] = cost[starts]
        stay = np.where(computed, cost + (isinstance(token, str)), never)
        cost = through_empty_computed(np.minimum(stay, step))
        if cost.min() >= never:
            return None
    return int(cost.min())


def _tokens(run: str) -> list[str | tuple[str]]:
    """A run of the table's column as characters and (placeholder,)s."""
    tokens: list[str | tuple[str]] = []
    for index, piece in enumerate(re.split(f"({PLACEHOLDER.pattern})", run)):
        tokens += [(piece,)] if index % 2 else list(piece)
    return tokens


def troubleshooting_messages() -> list[tuple[int, str]]:
    """(line, message column) of every table row of docs/troubleshooting.md."""
    with open(os.path.join(REPO, "docs", "troubleshooting.md")) as handle:
        rows = [(number, line) for number, line in enumerate(handle, start=1) if re.match(r"^\| `\w+`", line)]
    return [(number, re.split(r"(?<!\\) \| ", line)[1]) for number, line in rows]


def test_every_message_the_troubleshooting_table_quotes_is_one_the_package_raises() -> None:
    """Each run of quoted text (between the "..." that leave text out) is one that a string of
    the package produces, so a message reworded in the code and not in the table fails here."""
    strings = [(s, set(WORD.findall(s))) for s in _package_strings()]
    messages = troubleshooting_messages()
    assert len(messages) > 80, "the table's rows are missing"
    stale = []
    for number, message in messages:
        # A run's edges are often the brackets around a left-out list: "(...); name the one..."
        for run in filter(None, (r.strip(" ([]);,:.") for r in message.split("..."))):
            quoted = _tokens(run)
            words = set(WORD.findall(PLACEHOLDER.sub(" ", run)))
            fills = [_fewest_filled(s, quoted) for s, held in strings if len(words & held) >= len(words) / 2]
            if not any(f is not None and f <= max(MOST_FILLED, len(run) / 3) for f in fills):
                stale.append(f"docs/troubleshooting.md:{number}: {run!r}")
    assert not stale, "messages the table quotes that no string of megatron_fsdp produces:\n" + "\n".join(stale)
