"""Hugging Face's training loops on a model sharded by ``megatron_fsdp.fully_shard``
(docs/hugging_face.md).

Accelerate needs nothing from here to train: ``accelerator.prepare`` leaves a sharded model as it
is (the wrapper says it is prepared), takes its optimizer, and ``backward``, ``accumulate``,
``clip_grad_norm_``, ``get_state_dict`` and ``unwrap_model(model).save_pretrained`` work on it.
Two things Hugging Face's own loops do on the first rank alone need every rank's pieces:

- Accelerate's ``save_state`` writes the first rank's state dicts, and ``load_state`` reads
  them on every rank: inside :func:`full_state_dicts` those state dicts hold full tensors.
- Trainer writes the model, the optimizer and the checkpoints from the first rank and builds
  its own optimizer: :class:`MegatronFSDPTrainer` is Trainer with those steps done on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Trainer
from transformers.utils import can_return_loss, find_labels

from megatron_fsdp.checkpoint.pretrained import gathered_state_dict
from megatron_fsdp.checkpoint.state_dicts import fqn_keyed_optimizer_state_dict
from megatron_fsdp.fully_shard import fully_shard_optimizer
from megatron_fsdp.megatron_fsdp import MegatronFSDP

logger = logging.getLogger(__name__)

# Trainer's file names (transformers.trainer): its checkpoint loader looks for them.
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
# The optimizer's DCP directory in a Trainer checkpoint: every rank writes its pieces there.
OPTIMIZER_DIR = "optimizer"


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer behind Accelerate's ``AcceleratedOptimizer`` (itself otherwise)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _full_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state-dict post-hook: every DTensor entry gathered into its full tensor on the host
    (collectives, so every rank asks for the state dict, as Accelerate's ``save_state`` does)."""
    return {
        **state_dict,
        "state": {
            key: {
                name: value.full_tensor().cpu() if isinstance(value, DTensor) else value
                for name, value in entries.items()
            }
            for key, entries in state_dict["state"].items()
        },
    }


@contextlib.contextmanager
def full_state_dicts(model: MegatronFSDP, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Inside, ``model.state_dict()`` and ``optimizer.state_dict()`` hold full tensors on every
    rank (gathered: call them on every rank) instead of this rank's pieces; loading takes each
    rank's piece from them as always. For loops that write the first rank's state dicts and
    read them back on every rank::

        with full_state_dicts(model, optimizer):
            accelerator.save_state(output_dir)
        with full_state_dicts(model, optimizer):
            accelerator.load_state(output_dir)

    The files are then those of an unsharded model (``model.safetensors`` loads into the plain
    model), at the cost of the full model and optimizer state in each rank's host memory while
    they are written. ``torch.distributed.checkpoint`` (``megatron_fsdp.save_checkpoint``) writes
    each rank's pieces instead."""
    if not isinstance(model, MegatronFSDP):
        raise TypeError(f"full_state_dicts takes the model megatron_fsdp.fully_shard returned, got {type(model).__name__}")
    # Shadows the wrapper's state_dict for this block only (an instance attribute over the method).
    model.state_dict = functools.partial(_full_model_state_dict, model)
    hook = None if optimizer is None else _torch_optimizer(optimizer).register_state_dict_post_hook(_full_optimizer_state)
    try:
        yield
    finally:
        del model.state_dict
        if hook is not None:
            hook.remove()


def _full_model_state_dict(model: MegatronFSDP, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return gathered_state_dict(MegatronFSDP.state_dict(model, *args, **kwargs), keep=True)


class MegatronFSDPTrainer(Trainer):
    """``transformers.Trainer`` for a model that ``megatron_fsdp.fully_shard`` sharded, with
    Trainer's own arguments and defaults. What it does differently, only for such a model:

    - the optimizer Trainer builds (or one passed in ``optimizers``) steps the shards
      (``fully_shard_optimizer``), and weight decay skips the parameters Trainer's own rule
      names (biases, norms);
    - ``save_model`` gathers the full weights on every rank and the first writes what
      ``from_pretrained`` loads;
    - checkpoints hold the optimizer as each rank's pieces (``torch.distributed.checkpoint``,
      in ``optimizer/``), so ``train(resume_from_checkpoint=...)`` resumes exactly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sharded = self._sharded_model()
        if sharded is not None:
            # Trainer reads these off the model's class, whose forward takes anything here.
            if self.args.label_names is None:
                self.label_names = find_labels(type(sharded.module))
            self.can_return_loss = can_return_loss(type(sharded.module))

    def _sharded_model(self) -> MegatronFSDP | None:
        return self.model if isinstance(self.model, MegatronFSDP) else None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        sharded = self._sharded_model()
        if sharded is not None and getattr(_torch_optimizer(optimizer), "_megatron_fsdp_model", None) is None:
            fully_shard_optimizer(optimizer, model=sharded)
        return optimizer

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        # The wrapper's parameters are named as the wrapped model's, which Trainer's rule walks.
        return super().get_decay_parameter_names(model.module if isinstance(model, MegatronFSDP) else model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._sharded_model() is None:
            super().save_model(output_dir, _internal_call)
            return
        # _save gathers the weights, so every rank must call it; Trainer's own save_model calls it
        # on every rank in Transformers 5.23 but on the writing rank alone in 5.17, where the other
        # ranks then went on to the optimizer's collectives (found over NCCL at world 2).
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        sharded = self._sharded_model()
        if sharded is None:
            super()._save(output_dir, state_dict)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        sharded.save_pretrained(output_dir, state_dict=state_dict, is_main_process=self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        sharded = self._sharded_model()
        if sharded is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        optimizer = _torch_optimizer(self.optimizer)
        state = {"optimizer": fqn_keyed_optimizer_state_dict(optimizer.state_dict(), optimizer, sharded)}
        dcp.save(state, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        sharded = self._sharded_model()
        if sharded is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer = _torch_optimizer(self.optimizer)
        optimizer_dir = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(optimizer_dir):
            raise FileNotFoundError(
                f"{checkpoint} holds no {OPTIMIZER_DIR}/ written by MegatronFSDPTrainer: resume from a checkpoint it "
                "wrote, or start afresh (train() without resume_from_checkpoint)"
            )
        # A fresh optimizer's state dict holds tensors dcp.load fills in place.
        state = {"optimizer": fqn_keyed_optimizer_state_dict(optimizer.state_dict(), optimizer, sharded)}
        dcp.load(state, checkpoint_id=optimizer_dir)
        optimizer.load_state_dict(state["optimizer"])
        with warnings.catch_warnings(record=True):  # torch warns about saving scheduler state
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
