"""examples/hf_trainer.py's pieces: Transformers' Trainer on a model sharded by
``megatron_fsdp.fully_shard`` (issue 38), on 2 gloo ranks, through ``MegatronFSDPTrainer`` with
Trainer's defaults (remove_unused_columns,
save_strategy="steps", max_grad_norm, a linear schedule, gradient accumulation, the optimizer
Trainer builds or one passed in): it trains like the single-process Trainer on the same data,
``save_model`` writes what ``from_pretrained`` loads exactly, and ``train(resume_from_checkpoint=
...)`` from a step checkpoint ends bit for bit where the uninterrupted run did."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import hf_llama  # noqa: E402
import hf_trainer  # noqa: E402
from _dist import run_distributed, use_deterministic_kernels  # noqa: E402
from transformers import LlamaForCausalLM, Trainer  # noqa: E402

WORLD, ROWS, SEQ, ACCUM, STEPS, LR = 2, 2, 32, 2, 4, 3e-3


def _rows_in_all(world: int) -> int:
    return STEPS * ACCUM * world * ROWS


def _arguments(output_dir: str, rows_per_device: int):
    return hf_trainer.training_arguments(output_dir, rows_per_device, STEPS, LR, ACCUM)


def _passed_in_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def _logged(trainer: Trainer) -> dict[str, list[float]]:
    """The loss and gradient norm (before the clip) Trainer logged at each step."""
    return {key: [entry[key] for entry in trainer.state.log_history if key in entry] for key in ("loss", "grad_norm")}


def _weight_decays(trainer: Trainer) -> dict[str, float]:
    """Each parameter's weight decay in the optimizer Trainer built."""
    names = {param: name for name, param in trainer.model.named_parameters()}
    return {names[param]: group["weight_decay"] for group in trainer.optimizer.param_groups for param in group["params"]}


def _reset_accelerate() -> None:
    """Accelerate keeps its state in process-wide singletons; each run starts and ends clean."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _on_host(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in params.items()}


def _sharded(rank: int, world: int, out_dir: str, device_type: str = "cpu") -> dict:
    from megatron_fsdp.integrations.hugging_face import MegatronFSDPTrainer

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets: Trainer's Accelerate reads it
    os.environ["OMP_NUM_THREADS"] = "1"  # else Accelerate gives each rank every core
    use_deterministic_kernels()
    rows_in_all = _rows_in_all(world)

    def sharded_llama(seed: int = 0):
        return hf_trainer.shard(hf_llama.build_model(hf_llama.tiny_llama_config(), seed=seed).to(device_type))

    results = {}
    _reset_accelerate()  # a pooled process may hold an earlier run's Accelerate state
    try:
        run_dir = os.path.join(out_dir, "run")
        trainer = hf_trainer.build_trainer(sharded_llama(), _arguments(run_dir, ROWS), rows_in_all, SEQ)
        trainer.train()
        results["logged"] = _logged(trainer)
        results["weight_decays"] = _weight_decays(trainer)
        results["params"] = _on_host(trainer.model.full_parameters())
        results["saved_dir"] = os.path.join(out_dir, "saved")
        trainer.save_model(results["saved_dir"])

        # Resumed from the step checkpoint into other weights, a fresh optimizer and schedule.
        resumed = hf_trainer.build_trainer(sharded_llama(seed=7), _arguments(run_dir, ROWS), rows_in_all, SEQ)
        resumed.train(resume_from_checkpoint=os.path.join(run_dir, f"checkpoint-{STEPS // 2}"))
        params = _on_host(resumed.model.full_parameters())
        results["resumed_exactly"] = {name: torch.equal(value, results["params"][name]) for name, value in params.items()}

        model = sharded_llama()
        passed_in = MegatronFSDPTrainer(
            model=model, args=_arguments(os.path.join(out_dir, "passed_in"), ROWS), train_dataset=hf_trainer.dataset(rows_in_all, SEQ),
            optimizers=(_passed_in_optimizer(model), None),
        )
        passed_in.train()
        results["passed_in_logged"] = _logged(passed_in)
        results["passed_in_params"] = _on_host(model.full_parameters())
    finally:
        _reset_accelerate()
    return results


def reference_run(output_dir: str, pass_optimizer: bool, world: int = WORLD) -> dict:
    """The plain Trainer in one process, each step's whole global batch on it (on the GPU where
    there is one, as Trainer chooses)."""
    use_deterministic_kernels()
    try:
        model = hf_llama.build_model(hf_llama.tiny_llama_config())
        optimizers = (_passed_in_optimizer(model), None) if pass_optimizer else (None, None)
        trainer = Trainer(
            model=model, args=_arguments(output_dir, ROWS * world), train_dataset=hf_trainer.dataset(_rows_in_all(world), SEQ),
            optimizers=optimizers,
        )
        trainer.train()
        return {
            "logged": _logged(trainer),
            "weight_decays": _weight_decays(trainer),
            "params": _on_host(dict(model.named_parameters())),
        }
    finally:
        _reset_accelerate()
        torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    return sharded_run(WORLD, str(tmp_path_factory.mktemp("hf_trainer")))


def sharded_run(world: int, out_dir: str, device_type: str = "cpu", backend: str = "gloo") -> dict:
    return run_distributed(_sharded, world, out_dir, device_type, backend=backend)[0]


# fp32. Trainer logs each step's loss averaged over ranks and micro-batches, and the gradient
# norm; the sharded run sums two ranks' gradients where the reference differentiates a batch
# twice the size, the same values rounded in another order (1.1e-7 relative at most over these
# steps, measured). A dropped micro-batch or an extra optimizer step moves them by 1e-3 or more;
# weight decay on the wrong parameters moves losses by only ~1e-5 here, so the decay of each
# parameter is compared itself.
RTOL = 1e-5
# AdamW moves each element by about lr whatever its gradient's size: rounding noise in a nearly
# zero gradient can flip part of one update (test_hf_llama.py measured lr / 120); a wrong or
# missing update is off by a whole lr.
PARAM_ATOL = LR / 10


def check_training(sharded: dict, expected: dict, optimizer: str) -> None:
    """Logged losses and gradient norms, weight decays and final weights against the plain Trainer's."""
    logged = sharded["logged" if optimizer == "trainers" else "passed_in_logged"]
    params = sharded["params" if optimizer == "trainers" else "passed_in_params"]
    if optimizer == "trainers":
        # Trainer leaves biases and norms out of weight decay by their names.
        assert sharded["weight_decays"] == expected["weight_decays"]
    for key, values in expected["logged"].items():
        assert len(logged[key]) == len(values) == STEPS, f"{optimizer}: {key} logged {len(logged[key])} times"
        for step, (a, b) in enumerate(zip(logged[key], values)):
            assert abs(a - b) <= RTOL * abs(b), f"{optimizer}: {key} at step {step}: sharded {a} vs single process {b}"
    for name, value in expected["params"].items():
        err = (params[name] - value).abs().max().item()
        assert err <= PARAM_ATOL, f"{optimizer}: {name}: max error {err:.2e}"


def check_saved_model_loads(sharded: dict) -> None:
    loaded = dict(LlamaForCausalLM.from_pretrained(sharded["saved_dir"]).named_parameters())
    assert loaded.keys() == sharded["params"].keys()
    for name, value in sharded["params"].items():
        assert torch.equal(loaded[name].detach(), value), f"{name} differs after save_model / from_pretrained"


def check_resumed_exactly(sharded: dict) -> None:
    differing = [name for name, equal in sharded["resumed_exactly"].items() if not equal]
    assert not differing, f"resumed training differs from the uninterrupted run in {differing}"


@pytest.mark.parametrize("optimizer", ["trainers", "passed_in"])
def test_trainer_trains_a_sharded_model_like_the_single_process_trainer(sharded, tmp_path, optimizer: str) -> None:
    check_training(sharded, reference_run(str(tmp_path), pass_optimizer=optimizer == "passed_in"), optimizer)


def test_save_model_writes_what_from_pretrained_loads(sharded) -> None:
    check_saved_model_loads(sharded)


def test_resume_from_a_step_checkpoint_ends_where_the_uninterrupted_run_did(sharded) -> None:
    check_resumed_exactly(sharded)


def _plain_trainer(rank: int, world: int, out_dir: str) -> str:
    """transformers.Trainer itself over a sharded model: it builds an optimizer nobody shards."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    _reset_accelerate()
    try:
        model = hf_trainer.shard(hf_llama.build_model(hf_llama.tiny_llama_config()))
        before = {name: value.clone() for name, value in model.full_parameters().items()}
        trainer = Trainer(model=model, args=_arguments(out_dir, ROWS), train_dataset=hf_trainer.dataset(_rows_in_all(world), SEQ))
        with pytest.raises(RuntimeError) as error:
            trainer.train()
        unchanged = all(torch.equal(value, before[name]) for name, value in model.full_parameters().items())
        return f"{error.value} | weights unchanged: {unchanged}"
    finally:
        _reset_accelerate()


def test_plain_trainer_building_its_own_optimizer_is_refused_at_its_first_step(tmp_path) -> None:
    """Trainer's optimizer over the sharded faces would step the main weights without installing
    them and add every step's gradients to the last (silently wrong): its first step raises on
    every rank, naming MegatronFSDPTrainer, before any weight changes."""
    for message in run_distributed(_plain_trainer, WORLD, str(tmp_path)):
        assert "was not sharded with it" in message and "MegatronFSDPTrainer" in message, message
        assert message.endswith("weights unchanged: True"), message
