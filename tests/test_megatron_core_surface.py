"""The surface megatron-core reaches into, without megatron-core (CI has no Python 3.12 / CUDA):
the import path install() answers, the compat modules' names and meanings (compared with a
single process), and megatron-core's way of driving a model (optimizer built from the wrapper's
``named_parameters()``, clipping on local gradients, fsdp_dtensor save/load) on gloo ranks.
tests/gpu/test_megatron_core.py runs megatron-core itself."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from _dist import run_distributed
from mcore_flow import fsdp_dtensor_state, load_fsdp_dtensor, megatron_core_clip
from models import Block, TinyGPT, make_batch

import megatron_fsdp
from megatron_fsdp import param_and_grad_buffer, uneven_dtensor, utils
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from megatron_fsdp.integrations.mcore_optimizer_steps import install_piece_steps

REPO = Path(__file__).resolve().parent.parent
UPSTREAM = "megatron.core.distributed.fsdp.src.megatron_fsdp"
STRATEGIES = ["optim", "optim_grads", "optim_grads_params"]


def test_compat_modules_have_the_names_megatron_core_imports():
    for module, names in {
        utils: ["FSDPDistributedIndex", "find_megatron_fsdp", "get_mcore_tensor_parallel_partition_dim",
                "is_mcore_tensor_model_parallel", "is_mcore_tensor_parallel_duplicated"],
        param_and_grad_buffer: ["make_fsdp_dtensor", "ParamAndGradBuffer", "to_local_if_dtensor"],
        uneven_dtensor: ["split_dtensor", "uneven_dtensor_to_full_tensor", "preprocess_state_dict_for_uneven_dtensor"],
    }.items():
        missing = [name for name in names if not callable(getattr(module, name, None))]
        assert not missing, f"{module.__name__} lacks {missing}"


def test_tensor_parallel_marks_read_like_upstream():
    column, row, marked, plain = (nn.Parameter(torch.zeros(2)) for _ in range(4))
    column._tensor_parallel_mode = "column"
    row._tensor_parallel_mode = "row"
    marked.tensor_model_parallel, marked.partition_dim = True, 1
    dims = [utils.get_mcore_tensor_parallel_partition_dim(p) for p in (column, row, marked, plain)]
    assert dims == [0, 1, 1, None]
    assert [utils.is_mcore_tensor_model_parallel(p) for p in (column, plain)] == [True, False]
    assert utils.is_mcore_tensor_parallel_duplicated(plain)


def _fake_megatron_core(root: Path) -> None:
    """megatron-core's package path down to its bundled copy, whose import fails loudly."""
    package = root
    for part in UPSTREAM.split("."):
        package = package / part
        package.mkdir()
        (package / "__init__.py").touch()
    (package / "__init__.py").write_text("raise ImportError('the bundled copy was imported')\n")
    # megatron-core's adapter: imports the bundled package, defines its world-size mesh helpers
    # (0.19's signatures, which install() checks before replacing them).
    (root / "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py").write_text(
        f"from {UPSTREAM} import MegatronFSDP\n"
        "def _get_dp_tp_mesh(dp_cp_group, tp_group, ep_size=1): raise AssertionError('the world-size layout')\n"
        "def _get_hsdp_tp_mesh(outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size=1):\n"
        "    raise AssertionError('the world-size layout')\n"
        "ADAPTER_BODY_RAN = True\n"
    )
    # Its fsdp_dtensor checkpoint helpers, whose SwiGLU splitter Megatron-LM's checkpointing imports by name.
    (root / "megatron/core/transformer").mkdir()
    (root / "megatron/core/transformer/__init__.py").touch()
    (root / "megatron/core/transformer/fsdp_dtensor_checkpoint.py").write_text(
        "def handle_swiglu_in_state_dict(model, model_state_dict, optimizer_state_dict):\n    raise AssertionError('megatron-core splitter')\n"
        "CHECKPOINT_BODY_RAN = True\n"
    )


def _run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)


def test_install_answers_the_bundled_import_path_with_megatron_fsdp(tmp_path):
    _fake_megatron_core(tmp_path)
    result = _run_python(
        f"""
        import megatron_fsdp, megatron_fsdp.utils, megatron_fsdp.uneven_dtensor, megatron_fsdp.param_and_grad_buffer
        from megatron_fsdp.integrations import megatron_core
        from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
        megatron_core.install()
        megatron_core.install()  # twice is harmless
        from {UPSTREAM} import FSDPDistributedIndex, MegatronFSDP, MixedPrecisionPolicy
        from {UPSTREAM}.utils import find_megatron_fsdp, get_mcore_tensor_parallel_partition_dim
        from {UPSTREAM}.param_and_grad_buffer import make_fsdp_dtensor
        from {UPSTREAM}.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
        import {UPSTREAM}.utils as aliased_utils
        assert MegatronFSDP is MegatronCoreFSDP and issubclass(MegatronFSDP, megatron_fsdp.MegatronFSDP)
        assert FSDPDistributedIndex is megatron_fsdp.FSDPDistributedIndex
        assert MixedPrecisionPolicy is megatron_fsdp.MixedPrecisionPolicy
        assert aliased_utils is megatron_fsdp.utils and find_megatron_fsdp is megatron_fsdp.utils.find_megatron_fsdp
        assert make_fsdp_dtensor is megatron_fsdp.param_and_grad_buffer.make_fsdp_dtensor
        assert preprocess_state_dict_for_uneven_dtensor is megatron_fsdp.uneven_dtensor.preprocess_state_dict_for_uneven_dtensor
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
        from megatron_fsdp.integrations import mcore_adapter_meshes
        assert mcore_fsdp_adapter.ADAPTER_BODY_RAN  # megatron-core's own module, loaded as it is
        assert mcore_fsdp_adapter._get_dp_tp_mesh is mcore_adapter_meshes.dp_tp_mesh
        assert mcore_fsdp_adapter._get_hsdp_tp_mesh is mcore_adapter_meshes.hsdp_tp_mesh
        from megatron.core.transformer.fsdp_dtensor_checkpoint import CHECKPOINT_BODY_RAN, handle_swiglu_in_state_dict
        from megatron_fsdp.integrations.mcore_gated_fc1 import split_gated_linear_fc1
        assert CHECKPOINT_BODY_RAN and handle_swiglu_in_state_dict is split_gated_linear_fc1
        try:
            import {UPSTREAM}.fully_shard_internals
        except ModuleNotFoundError as error:
            assert "fully_shard_internals" in str(error) and "utils" in str(error), error
        else:
            raise AssertionError("an unknown upstream submodule imported")
        print("ok")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_install_after_megatron_core_imported_its_copy_raises(tmp_path):
    _fake_megatron_core(tmp_path)
    bundled = tmp_path / "megatron/core/distributed/fsdp/src/megatron_fsdp/__init__.py"
    bundled.write_text("BUNDLED = True\n")
    result = _run_python(
        f"""
        import {UPSTREAM}
        from megatron_fsdp.integrations import megatron_core
        try:
            megatron_core.install()
        except RuntimeError as error:
            assert "before the first" in str(error), error
            print("ok")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# -- uneven DTensors, against a single process -------------------------------------------------


def _uneven_rows(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    full = torch.randn(7, 5)
    template = torch.empty(7, 5, device="meta")
    # Upstream's layout: rank r holds a block of rows, here 4 and 3 (uneven).
    bounds = [0, 4, 7]
    index = megatron_fsdp.FSDPDistributedIndex(
        device_mesh=dist.init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)), dp_shard_dim="dp"
    )
    block = full[bounds[rank] : bounds[rank + 1]].clone()
    dtensor = param_and_grad_buffer.make_fsdp_dtensor(block, template, index, run_check=True, update_uneven_dtensor_chunk_meta=True)
    assert dtensor.shape == full.shape and dtensor.placements == (Shard(0),)
    torch.testing.assert_close(uneven_dtensor.uneven_dtensor_to_full_tensor(dtensor), full, rtol=0, atol=0)
    replicated = uneven_dtensor.redistribute_uneven_dtensor_to_replicated(dtensor)
    torch.testing.assert_close(replicated.to_local(), full, rtol=0, atol=0)
    sections = list(uneven_dtensor.split_dtensor(dtensor, [2, 3, 2], dim=0, update_uneven_dtensor_chunk_meta=True))
    for section, expected in zip(sections, torch.split(full, [2, 3, 2])):
        torch.testing.assert_close(uneven_dtensor.uneven_dtensor_to_full_tensor(section), expected, rtol=0, atol=0)
    unsharded = param_and_grad_buffer.make_fsdp_dtensor(full.clone(), template, index, is_sharded_param=False)
    assert unsharded.placements == (Replicate(),)
    torch.testing.assert_close(uneven_dtensor.uneven_dtensor_to_full_tensor(unsharded), full, rtol=0, atol=0)


def test_uneven_row_blocks_gather_split_like_a_single_process():
    run_distributed(_uneven_rows, 2)


def _flat_pieces(rank: int, world_size: int, strategy: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(tie=False)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    sharded = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    state = sharded.state_dict()
    assert uneven_dtensor.preprocess_state_dict_for_uneven_dtensor({"model": state}) == {"model": state}
    for name, expected in reference.items():
        full = uneven_dtensor.uneven_dtensor_to_full_tensor(state[name])
        torch.testing.assert_close(full, expected, rtol=0, atol=0, msg=name)
    pieces = [v for v in state.values() if uneven_dtensor.is_flat_piece(v)]
    assert pieces, "the tiny model's parameters should straddle shards"
    with pytest.raises(NotImplementedError, match="flat piece"):
        next(uneven_dtensor.split_dtensor(pieces[0], 1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flat_pieces_gather_like_a_single_process(strategy):
    run_distributed(_flat_pieces, 2, strategy)


# -- megatron-core's way of driving the model -------------------------------------------------


class _Adapter(nn.Module):
    """Stands for megatron-core's FullyShardedDataParallel: holds the sharded model as
    ``module`` and is walked as a plain nn.Module."""

    def __init__(self, strategy: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, overlap_param_gather=True
        )
        self.module = MegatronCoreFSDP(TinyGPT(tie=False), None, config, fsdp_unit_modules=[Block])


def _optimizer(adapter: _Adapter) -> torch.optim.Optimizer:
    # megatron-core builds its param groups from the wrapper's named_parameters(): no weight
    # decay for biases and 1-D parameters.
    named = list(adapter.named_parameters())
    no_decay = [p for n, p in named if p.dim() == 1 or n.endswith(".bias")]
    decay = [p for n, p in named if not (p.dim() == 1 or n.endswith(".bias"))]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)


def _train_step(adapter: _Adapter, optimizer: torch.optim.Optimizer, step: int, rank: int, world_size: int) -> tuple[float, float]:
    tokens, targets = make_batch(step, 4 * world_size)
    rows = slice(4 * rank, 4 * rank + 4)
    losses = []
    with adapter.module.no_sync():  # two micro-batches, as megatron-core's schedule runs them
        loss = adapter.module(tokens[rows][:2], targets[rows][:2]) / 2
        loss.backward()
        losses.append(loss.detach())
    loss = adapter.module(tokens[rows][2:], targets[rows][2:]) / 2
    loss.backward()
    losses.append(loss.detach())
    adapter.module.finish_grad_sync()  # finalize_model_grads
    norm = megatron_core_clip(optimizer, 1.0)
    optimizer.step()
    adapter.module.param_and_grad_buffer.copy_main_weights_to_model_weights()
    adapter.module.zero_grad_buffer()
    total = torch.stack(losses).sum()
    dist.all_reduce(total)
    return total.item() / world_size, norm


def _reference_run(steps: int, world_size: int) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT(tie=False)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if not (p.dim() == 1 or n.endswith(".bias"))]},
         {"params": [p for n, p in named if p.dim() == 1 or n.endswith(".bias")], "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.1,
    )
    history = []
    for step in range(steps):
        tokens, targets = make_batch(step, 4 * world_size)
        loss = sum(model(tokens[4 * r : 4 * r + 4], targets[4 * r : 4 * r + 4]) for r in range(world_size)) / world_size
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss.item(), norm))
    return history, {n: p.detach().clone() for n, p in model.named_parameters()}


def _megatron_core_flow(rank: int, world_size: int, strategy: str, checkpoint_dir: str) -> dict:
    # What install() puts: megatron-core's optimizer steps the plain pieces under the faces.
    handles = install_piece_steps()
    try:
        return _megatron_core_flow_with_piece_steps(strategy, rank, world_size, checkpoint_dir)
    finally:
        for handle in handles:
            handle.remove()


def _megatron_core_flow_with_piece_steps(strategy: str, rank: int, world_size: int, checkpoint_dir: str) -> dict:
    adapter = _Adapter(strategy)
    names = [n for n, _ in adapter.named_parameters()]
    assert names[0].startswith("module.module.") and all(isinstance(p, DTensor) for p in adapter.parameters())
    optimizer = _optimizer(adapter)
    stepped_types = set()
    optimizer.register_step_pre_hook(  # runs after the global hooks: what torch's step iterates
        lambda opt, args, kwargs: stepped_types.update(type(p) for g in opt.param_groups for p in g["params"])
    )
    history = [_train_step(adapter, optimizer, step, rank, world_size) for step in range(3)]
    assert stepped_types == {torch.nn.Parameter}, f"the optimizer stepped {stepped_types}, not the plain pieces"
    assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]), "faces between steps"

    assert all(key.startswith("module.") for key in adapter.module.state_dict())
    dcp.save(fsdp_dtensor_state(adapter, optimizer), checkpoint_id=checkpoint_dir)
    continued = [_train_step(adapter, optimizer, step, rank, world_size) for step in range(3, 5)]

    # Fresh objects, other initial weights.
    torch.manual_seed(1)
    resumed = _Adapter(strategy)
    resumed_optimizer = _optimizer(resumed)
    load_fsdp_dtensor(resumed, resumed_optimizer, checkpoint_dir)
    after = [_train_step(resumed, resumed_optimizer, step, rank, world_size) for step in range(3, 5)]
    full = resumed.module.full_parameters()
    return {"history": history + continued, "resumed": after, "params": full, "names": names}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_core_flow_trains_and_resumes_like_a_single_process(strategy, tmp_path):
    world_size = 2
    results = run_distributed(_megatron_core_flow, world_size, strategy, str(tmp_path / "ckpt"))
    reference, reference_params = _reference_run(5, world_size)
    ours = results[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours["history"], reference)):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), f"step {step}: loss {loss} vs single process {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), f"step {step}: grad norm {norm} vs single process {ref_norm}"
    assert ours["resumed"] == ours["history"][3:], f"resumed {ours['resumed']} vs continued {ours['history'][3:]}"
    # Adam normalises every update to about lr = 1e-2, so summation-order rounding in a small
    # gradient can move an element by a fraction of one update: 1e-5 absolute is a thousandth of
    # one (atol 1e-6 failed on one bias element by 4e-6 on an AVX2 host).
    for name, expected in reference_params.items():
        torch.testing.assert_close(ours["params"][name], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
