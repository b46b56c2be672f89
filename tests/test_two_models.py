"""Two models sharded in one process (a student and its teacher, or a model and its EMA copy),
each with its own optimizer and trained interleaved, train exactly as each would alone, and
neither sees the other's state: what megatron_fsdp keeps per model (which optimizer's gradients
were cleared, optim/grad_release.py; the swap of a plain optimizer's faces for their pieces,
optim/global_step_hooks.py) hangs off that model or its optimizer and goes with it.

One gloo rank: the sharded step is then the plain step on the same values, elementwise and in the
same order, so the reference is a plain torch model and optimizer and the comparison is exact.
"""

from __future__ import annotations

import gc
import weakref

import torch

import megatron_fsdp
from megatron_fsdp import fsdp2
from megatron_fsdp.optim.grad_release import grad_release_of
from models import Block, make_batch, make_model

STEPS, ROWS = 3, 2


def _student_and_teacher_optimizers(student: torch.nn.Module, teacher: torch.nn.Module):
    # Different optimizers and rates, so a step that reached the other model's pieces would show.
    return torch.optim.Adam(student.parameters(), lr=1e-2), torch.optim.SGD(teacher.parameters(), lr=1e-1, momentum=0.9)


def _train_interleaved(models, optimizers, steps: range) -> None:
    """Backward of both before either steps: each optimizer's step and zero_grad must touch only
    its own model's gradients while the other's are held."""
    for step in steps:
        for offset, model in enumerate(models):
            model(*make_batch(10 * offset + step, ROWS)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _references() -> list[dict[str, torch.Tensor]]:
    """Each model trained alone, plain torch."""
    results = []
    for offset, seed in enumerate((0, 1)):
        model = make_model(seed=seed)
        optimizer = _student_and_teacher_optimizers(model, model)[offset]
        for step in range(STEPS):
            model(*make_batch(10 * offset + step, ROWS)).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append({name: param.detach().clone() for name, param in model.named_parameters()})
    return results


def _full_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}


def _assert_each_matches_its_reference(models) -> None:
    for label, model, reference in zip(("student", "teacher"), models, _references()):
        found = _full_values(model)
        assert found.keys() == reference.keys(), label
        for name, expected in reference.items():
            gap = (found[name] - expected).abs().max().item()
            assert gap == 0.0, f"{label} {name}: {gap:.3e} from training it alone"


def _freed(model_ref: weakref.ref, state_refs: list[weakref.ref]) -> bool:
    gc.collect()
    return model_ref() is None and all(ref() is None for ref in state_refs)


def test_two_wrapped_models_train_as_each_alone_and_keep_their_own_gradient_release(single_rank_group) -> None:
    student_plain, teacher_plain = make_model(seed=0), make_model(seed=1)
    student, student_optimizer = megatron_fsdp.fully_shard(
        student_plain, _student_and_teacher_optimizers(student_plain, student_plain)[0], fsdp_unit_modules=[Block]
    )
    teacher, teacher_optimizer = megatron_fsdp.fully_shard(
        teacher_plain, _student_and_teacher_optimizers(teacher_plain, teacher_plain)[1], fsdp_unit_modules=[Block]
    )
    models, optimizers = (student, teacher), (student_optimizer, teacher_optimizer)
    _train_interleaved(models, optimizers, range(STEPS))
    _assert_each_matches_its_reference(models)

    # Each model holds its own release, which knows its own optimizer only.
    assert grad_release_of(student) is not grad_release_of(teacher)
    assert set(grad_release_of(student)._optimizers) == {student_optimizer}
    # The student's zero_grad releases the student's gradients and leaves the teacher's.
    for offset, model in enumerate(models):
        model(*make_batch(100 + offset, ROWS)).backward()
    student_optimizer.zero_grad()
    assert all(b.grads.main_grad is None for b in student.trainable_buckets())
    assert all(b.grads.main_grad is not None for b in teacher.trainable_buckets()), "the student cleared the teacher's"
    teacher_optimizer.zero_grad()

    # Freed with its model: the release goes too; the teacher's stays.
    freed = [weakref.ref(student), weakref.ref(grad_release_of(student))]
    del student, student_optimizer, student_plain, models, optimizers
    assert _freed(freed[0], freed[1:]), "the freed student's state outlived it"
    assert grad_release_of(teacher) is not None


def test_two_models_sharded_in_place_step_plain_optimizers_as_each_alone(single_rank_group) -> None:
    models = [make_model(seed=0), make_model(seed=1)]
    for model in models:
        for block in model.blocks:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
    optimizers = [_student_and_teacher_optimizers(models[0], models[0])[0], _student_and_teacher_optimizers(models[1], models[1])[1]]
    _train_interleaved(models, optimizers, range(STEPS))
    _assert_each_matches_its_reference(models)

    # Each optimizer holds its own swap, over its own model's buckets only.
    swaps = [vars(optimizer)["_megatron_fsdp_piece_steps"].entry.swap for optimizer in optimizers]
    for own, other in ((0, 1), (1, 0)):
        assert all(swaps[own].covers(param) for param in models[own].parameters())
        assert not any(swaps[own].covers(param) for param in models[other].parameters()), "a swap reached the other model"

    state_ref = weakref.ref(vars(optimizers[0])["_megatron_fsdp_piece_steps"])
    freed = weakref.ref(models[0])
    del models[0], optimizers[0], swaps, model
    assert _freed(freed, [state_ref]), "the freed student's step state outlived it"
    _train_interleaved(models, optimizers, range(STEPS, STEPS + 1))  # the teacher trains on alone
