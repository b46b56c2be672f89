"""megatron-core's pipeline parallelism on megatron_fsdp, without megatron-core: each rank's model
chunk built as megatron-core builds its GPT chunks (the first stage: the embedding and the first
half of the layers; the last: the other layers, the final norm and an output layer whose weight is
a copy of the embedding's, both marked ``shared_embedding``, the copy also ``shared``), each
wrapped by its own :class:`MegatronCoreFSDP` over the data-parallel group, and driven as
megatron-core's non-interleaved 1F1B schedule drives it: activations and their gradients sent
between the stages point to point, every micro-batch but each chunk's last under ``no_sync()``,
then its ``finalize_model_grads`` (``finish_grad_sync()`` per chunk, then the embedding group's
all-reduce of ``main_grad._local_tensor`` with the ``setattr`` it does after), its clip (squares
summed over the pipeline and data-parallel ranks, the ``shared`` copy left out) and the optimizer
step. World 4 = PP2 x DP2, pipeline stages outermost as megatron-core lays its ranks out; under
``optim`` and ``optim_grads_params`` (megatron-core's parallel_state stood in for, saying PP2: the
chunks hold weights and gradients between micro-batches, so the reductions and gathers of a step
are counted), each stage saved and resumed through DCP. Also megatron-core's interleaved schedule (two chunks a rank, one
optimizer over them), a tied weight's own bucket, and a weight object shared by two chunks on one
rank refused. tests/gpu/test_megatron_lm_pretrain.py runs ``pretrain_gpt.py`` with
``--pipeline-model-parallel-size 2``.

Compared with one process training the whole model, its output truly tied to the embedding, on
the whole batch. Tolerances: fp32 throughout; the pipelined run sums the same products in another
order (micro-batches, the data-parallel reduce-scatter, the tied weight's two halves added by the
embedding group), so losses and norms agree to fp32 rounding (1e-5 relative); Adam's update is
about lr an element whatever the gradient's size, so a rounding in a near-zero gradient moves a
parameter by a small fraction of lr = 1e-2 (``PARAM_ATOL`` says by how much here). A resumed run
repeats the saved run's own arithmetic: bit-equal.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from _dist import run_distributed
from mcore_flow import (
    fsdp_dtensor_chunks_state,
    fsdp_dtensor_state,
    load_fsdp_dtensor,
    megatron_core_clip,
    one_process_run,
)

import megatron_fsdp
from megatron_fsdp.engine.buckets.bucket_grads import BucketGrads
from megatron_fsdp.engine.buckets.bucket_weights import BucketWeights
from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.step.units import ROOT_UNIT_NAME, bucket_groups
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from megatron_fsdp.integrations.mcore_optimizer_steps import install_piece_steps

VOCAB, HIDDEN, FFN, SEQ, LAYERS = 24, 16, 32, 6, 4
PP, DP, MICRO_BATCHES, MICRO_ROWS = 2, 2, 4, 2
PARALLEL_STATE = "megatron.core.parallel_state"
STEPS, SAVED_AT = 4, 2
# Adam moves an element whose gradient is within rounding of zero by a fraction of lr whatever its
# size: layers.0.fc1.weight[4, 14]'s first gradient is -1.3e-8 (the median 7e-4), and that element
# ends up to 4.4e-5 from the one-process run's (0.4% of lr = 1e-2); every other is within 1e-5.
# Losses and norms measured within 6e-7 relative.
PARAM_ATOL = 1e-4


class TransformerLayer(nn.Module):
    """A pre-norm MLP block: the FSDP unit, as megatron-core's adapter makes its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Embedding(nn.Module):
    """megatron-core's LanguageModelEmbedding: word and position embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens) + self.position_embeddings.weight[: tokens.shape[1]]


class OutputLayer(nn.Module):
    """megatron-core's output ColumnParallelLinear without bias; ``weight`` None: the embedding's
    weight is passed in (one stage holding both, the reference's true tie)."""

    def __init__(self, own_weight: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN)) if own_weight else None

    def forward(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(h, self.weight if weight is None else weight)


class GPTChunk(nn.Module):
    """One pipeline stage's GPTModel: ``pre_process`` holds the embedding, ``post_process`` the
    final norm and output layer; both: the whole model, output tied to the embedding."""

    def __init__(self, layers: range, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.pre_process, self.post_process, self.layer_numbers = pre_process, post_process, layers
        if pre_process:
            self.embedding = Embedding()
        self.layers = nn.ModuleList(TransformerLayer() for _ in layers)
        if post_process:
            self.final_layernorm = nn.LayerNorm(HIDDEN)
            self.output_layer = OutputLayer(own_weight=not pre_process)
        self._load(initial_weights())
        self._setup_embeddings_and_output_layer()

    def _load(self, full: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(full[reference_name(self, name)])

    def _setup_embeddings_and_output_layer(self) -> None:
        """megatron-core's marks on the weight duplicated across the first and last stage (its
        all-reduce that makes the copies equal is left out: both are built equal here)."""
        if self.pre_process and not self.post_process:
            self.embedding.word_embeddings.weight.shared_embedding = True
        if self.post_process and not self.pre_process:
            weight = self.output_layer.weight
            weight.shared, weight.shared_embedding = True, True

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.embedding.word_embeddings.weight if self.pre_process else self.output_layer.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``x``: tokens on the first stage, the previous stage's activations elsewhere; the last
        stage returns the micro-batch's mean loss."""
        if self.pre_process:
            x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        if not self.post_process:
            return x
        tied = self.embedding.word_embeddings.weight if self.pre_process else None
        logits = self.output_layer(self.final_layernorm(x), tied)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference_name(chunk: GPTChunk, name: str) -> str:
    """A chunk parameter's name in the whole model (layers renumbered globally, the output
    copy named as the embedding it is tied to)."""
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    if name.startswith("layers."):
        _, local, rest = name.split(".", 2)
        return f"layers.{chunk.layer_numbers[int(local)]}.{rest}"
    return name


def initial_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        whole = GPTChunk.__new__(GPTChunk)
        nn.Module.__init__(whole)
        whole.embedding = Embedding()
        whole.layers = nn.ModuleList(TransformerLayer() for _ in range(LAYERS))
        whole.final_layernorm = nn.LayerNorm(HIDDEN)
    return {name: torch.randn(p.shape, generator=generator) * 0.3 for name, p in whole.named_parameters()}


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``DP x MICRO_BATCHES x MICRO_ROWS`` sequences."""
    generator = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (DP * MICRO_BATCHES * MICRO_ROWS, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def _micro_batch(step: int, dp_rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = make_batch(step)
    start = (dp_rank * MICRO_BATCHES + index) * MICRO_ROWS
    return tokens[start : start + MICRO_ROWS], targets[start : start + MICRO_ROWS]


# -- megatron-core's flow ---------------------------------------------------------------------


class _PipelineRank(nn.Module):
    """This rank's place in megatron-core's (pp, dp) layout, its groups, and the index and config
    its chunks are wrapped with."""

    def __init__(self, strategy: str) -> None:
        super().__init__()
        mesh = dist.init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
        self.pp_rank, self.dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        # The same data-parallel rank on every stage: megatron-core's embedding group for PP2.
        self.pp_group = mesh["pp"].get_group()
        self.dp_group = mesh["dp"].get_group()
        self.index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh["dp"], dp_shard_dim="dp")
        self.config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, overlap_param_gather=True,
        )

    def wrap(self, chunk: nn.Module) -> MegatronCoreFSDP:
        return MegatronCoreFSDP(chunk, self.index, self.config, fsdp_unit_modules=[TransformerLayer])

    def peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank % PP)


class Stage(_PipelineRank):
    """Stands for megatron-core's FullyShardedDataParallel over this rank's chunk (``module``), with
    its optimizer and groups."""

    def __init__(self, strategy: str) -> None:
        super().__init__(strategy)
        layers_each = LAYERS // PP
        self.module = self.wrap(GPTChunk(
            range(self.pp_rank * layers_each, (self.pp_rank + 1) * layers_each),
            pre_process=self.pp_rank == 0, post_process=self.pp_rank == PP - 1,
        ))
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2, weight_decay=0.1)
        # Gradient reductions started in each step: under no_sync, and after it; weight gathers.
        self.reductions: list[tuple[int, int]] = []
        self.under_no_sync = 0
        self.gathers: list[int] = []


def _one_f_one_b(stage: Stage, step: int, started: list[Bucket]) -> float:
    """megatron-core's forward_backward_pipelining_without_interleaving on PP2: the first stage
    runs one warm-up forward, then one forward and one backward a micro-batch, then the last
    backward; the last stage one forward and backward a micro-batch. Grad sync is off (no_sync)
    until the backward of the last micro-batch. Returns the sum of the micro-batches' losses."""
    model, first = stage.module, stage.pp_rank == 0
    sends, inputs, outputs, total = [], [], [], 0.0
    no_sync = model.no_sync()
    no_sync.__enter__()

    def forward(index: int) -> None:
        nonlocal total
        tokens, targets = _micro_batch(step, stage.dp_rank, index)
        if first:
            x = tokens
        else:
            x = torch.empty(MICRO_ROWS, SEQ, HIDDEN)
            dist.recv(x, src=stage.peer(0))
            x.requires_grad_(True)
        output = model(x, targets)
        if first:
            sends.append(dist.isend(output.detach().contiguous(), dst=stage.peer(1)))
        else:
            output = output / MICRO_BATCHES  # the schedule's forward_step divides by their number
            total += output.item()
        inputs.append(x)
        outputs.append(output)

    def backward(index: int) -> None:
        if index == MICRO_BATCHES - 1:
            no_sync.__exit__(None, None, None)  # enable_grad_sync before the last backward
            stage.under_no_sync = len(started)
        output = outputs.pop(0)
        x = inputs.pop(0)
        if first:
            grad = torch.empty_like(output)
            dist.recv(grad, src=stage.peer(1))
            torch.autograd.backward(output, grad)
        else:
            output.backward()
            sends.append(dist.isend(x.grad.contiguous(), dst=stage.peer(0)))

    _in_one_f_one_b_order(PP - stage.pp_rank - 1, MICRO_BATCHES, forward, backward)
    for send in sends:
        send.wait()
    return total


def _in_one_f_one_b_order(warmup: int, count: int, forward: Callable[[int], None], backward: Callable[[int], None]) -> None:
    """megatron-core's 1F1B order over ``count`` micro-batches: ``warmup`` forwards, then a
    forward and a backward each, then the backwards left."""
    for index in range(warmup):
        forward(index)
    for index in range(count - warmup):
        forward(index + warmup)
        backward(index)
    for index in range(count - warmup, count):
        backward(index)


def _all_reduce_tied_weight_grad(chunk: MegatronCoreFSDP, pp_group: dist.ProcessGroup) -> None:
    """finalize_model_grads' embedding-group step for Megatron-FSDP: the all-reduce of the tied
    weight's local gradient, set back as its ``main_grad`` (the gradient attribute it finds on the
    parameter, else ``grad``)."""
    weight = chunk.module.shared_embedding_or_output_weight()
    attribute = "main_grad" if hasattr(weight, "main_grad") else "grad"
    grad = getattr(weight, attribute)._local_tensor
    dist.all_reduce(grad, group=pp_group)
    setattr(weight, attribute, grad)


def _finalize_model_grads(stage: Stage) -> None:
    """megatron-core's finalize_model_grads for Megatron-FSDP on one chunk: the gradient sync,
    then the embedding group's all-reduce."""
    stage.module.finish_grad_sync()
    _all_reduce_tied_weight_grad(stage.module, stage.pp_group)


@contextlib.contextmanager
def _counting(life: type, method: str) -> Iterator[list[Bucket]]:
    """Each bucket whose ``method`` of one of its lives (a reduction or a gather starting) ran
    inside, in order (the pooled rank process gets the method back)."""
    started: list[Bucket] = []
    original = getattr(life, method)

    def counted(owned, *args, **kwargs):
        started.append(owned.bucket)
        return original(owned, *args, **kwargs)

    setattr(life, method, counted)
    try:
        yield started
    finally:
        setattr(life, method, original)


@contextlib.contextmanager
def _as_megatron_core_runs_it() -> Iterator[None]:
    """What install() puts (the optimizer steps the plain pieces), and what MegatronCoreFSDP reads
    of megatron-core's parallel_state (pipeline parallelism of size PP is up); both taken away after."""
    handles = install_piece_steps()
    sys.modules[PARALLEL_STATE] = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: True, get_pipeline_model_parallel_world_size=lambda: PP
    )
    try:
        yield
    finally:
        del sys.modules[PARALLEL_STATE]
        for handle in handles:
            handle.remove()


def _train_step(stage: Stage, step: int) -> tuple[float, float]:
    with _counting(BucketGrads, "start_reduction") as started, _counting(BucketWeights, "gather") as gathered:
        loss = torch.tensor(_one_f_one_b(stage, step, started))
        _finalize_model_grads(stage)
    stage.reductions.append((stage.under_no_sync, len(started) - stage.under_no_sync))
    stage.gathers.append(len(gathered))
    norm = megatron_core_clip(stage.optimizer, 0.5)
    stage.optimizer.step()
    stage.module.param_and_grad_buffer.copy_main_weights_to_model_weights()
    stage.module.zero_grad_buffer()
    # The loss lives on the last stage; averaged over its data-parallel ranks as megatron-core logs it.
    dist.all_reduce(loss)
    return loss.item() / DP, norm


def _flow(rank: int, world_size: int, checkpoint_dir: str, strategy: str) -> dict:
    with _as_megatron_core_runs_it():
        stage = Stage(strategy)
        stage_dir = f"{checkpoint_dir}/stage{stage.pp_rank}"
        history = [_train_step(stage, step) for step in range(SAVED_AT)]
        dcp.save(fsdp_dtensor_state(stage, stage.optimizer), checkpoint_id=stage_dir, process_group=stage.dp_group)
        history += [_train_step(stage, step) for step in range(SAVED_AT, STEPS)]
        state = stage.module.state_dict()
        full = {reference_name(stage.module.module, k.removeprefix("module.")): v.full_tensor() for k, v in state.items()}
        tied_face = stage.module.module.shared_embedding_or_output_weight()
        resumed = Stage(strategy)
        load_fsdp_dtensor(resumed, resumed.optimizer, stage_dir)
        return {
            "pp_rank": stage.pp_rank,
            "history": history,
            "full": full,
            "tied_slice": tied_face.megatron_fsdp_slice,
            "reductions": stage.reductions,
            "trainable_buckets": len(stage.module.trainable_buckets()),
            "gathers": stage.gathers,
            "buckets": sum(len(unit.buckets) for unit in stage.module.units),
            "resumed": [_train_step(resumed, step) for step in range(SAVED_AT, STEPS)],
        }


def _reference() -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    model = GPTChunk(range(LAYERS), pre_process=True, post_process=True)
    return one_process_run(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), make_batch, STEPS)


# Under pipeline parallelism every strategy holds the gradients back under no_sync and reduces
# each bucket once after the chunk's last micro-batch; optim_grads_params also keeps the weights
# gathered from the first forward to the last backward (integrations/mcore_pipeline.py).
STRATEGIES = ["optim", "optim_grads_params"]


def _history_like_one_process(results: list[dict]) -> dict[str, torch.Tensor]:
    """Checks that every rank logged the same losses and norms, each within 1e-5 of one process's;
    returns the one process's parameters after the last step."""
    reference, reference_params = _reference()
    ours = results[0]["history"]
    assert all(r["history"] == ours for r in results), "ranks disagree on the loss or the norm"
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, reference)):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), f"step {step}: loss {loss} vs one process {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), f"step {step}: grad norm {norm} vs one process {ref_norm}"
    return reference_params


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pipeline_stages_train_like_one_process_with_tied_embedding_and_resume_exactly(strategy, tmp_path):
    results = run_distributed(_flow, PP * DP, str(tmp_path / "ckpt"), strategy)
    reference_params = _history_like_one_process(results)
    first, last = (next(r for r in results if r["pp_rank"] == s) for s in range(PP))
    tied = "embedding.word_embeddings.weight"
    assert torch.equal(first["full"][tied], last["full"][tied]), "the tied copies drifted apart"
    held = first["full"] | last["full"]
    assert held.keys() == reference_params.keys()
    for name, expected in reference_params.items():
        torch.testing.assert_close(held[name], expected, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
    for result in results:
        assert result["resumed"] == result["history"][SAVED_AT:], f"resumed {result['resumed']} vs {result['history']}"
        buckets = result["trainable_buckets"]
        assert result["reductions"] == [(0, buckets)] * STEPS, (
            f"stage {result['pp_rank']}: reductions (under no_sync, after) {result['reductions']}, {buckets} buckets"
        )
        if strategy == "optim_grads_params":
            # One gather a bucket a step, for MICRO_BATCHES forwards and backwards.
            assert result["gathers"] == [result["buckets"]] * STEPS, (
                f"stage {result['pp_rank']}: gathers a step {result['gathers']}, {result['buckets']} buckets"
            )
    # megatron-core all-reduces the two copies' local gradients elementwise: the same range.
    assert first["tied_slice"] == last["tied_slice"], f"{first['tied_slice']} vs {last['tied_slice']}"


def test_a_weight_tied_across_stages_has_a_bucket_of_its_own():
    """Whatever else its module or unit holds, so that its shard range depends on its shape alone."""
    layer = TransformerLayer()
    layer.fc2.weight.shared_embedding = True
    for unit in (ROOT_UNIT_NAME, "layers.0"):
        groups = bucket_groups(unit, list(layer.named_parameters()))
        alone = [members for key, members in groups.items() if key.tied_across_stages]
        assert [[name for name, _ in members] for members in alone] == [["fc2.weight"]], groups.keys()


def _wrap_two_chunks_sharing_the_tied_weight(rank: int, world_size: int) -> str:
    """Both stages' chunks on one rank holding the same weight object for the embedding and
    the output layer, each wrapped as megatron-core wraps its chunks."""
    index = megatron_fsdp.FSDPDistributedIndex(
        device_mesh=dist.init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)), dp_shard_dim="dp"
    )
    config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    first = GPTChunk(range(0, 2), pre_process=True, post_process=False)
    last = GPTChunk(range(2, 4), pre_process=False, post_process=True)
    last.output_layer.weight = first.embedding.word_embeddings.weight
    MegatronCoreFSDP(first, index, config, fsdp_unit_modules=[TransformerLayer])
    try:
        MegatronCoreFSDP(last, index, config, fsdp_unit_modules=[TransformerLayer])
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_weight_shared_by_two_chunks_on_one_rank_is_refused_on_every_rank():
    for message in run_distributed(_wrap_two_chunks_sharing_the_tied_weight, 2):
        assert "['output_layer.weight'] are already sharded by another MegatronFSDP" in message, message
        assert "give each chunk its own copy" in message, message


# -- interleaved: two chunks a rank --------------------------------------------------------------

VIRTUAL = 2  # chunks a rank: virtual stage v * PP + pp_rank, one layer each


class InterleavedStage(_PipelineRank):
    """This rank's chunks, each under its own MegatronCoreFSDP (megatron-core's list of model
    chunks), and one optimizer over them all."""

    def __init__(self, strategy: str) -> None:
        super().__init__(strategy)
        layers_each = LAYERS // (PP * VIRTUAL)
        self.chunks = nn.ModuleList()
        for virtual in range(VIRTUAL):
            stage = virtual * PP + self.pp_rank
            self.chunks.append(self.wrap(GPTChunk(
                range(stage * layers_each, (stage + 1) * layers_each),
                pre_process=stage == 0, post_process=stage == PP * VIRTUAL - 1,
            )))
        self.optimizer = torch.optim.AdamW(self.chunks.parameters(), lr=1e-2, weight_decay=0.1)


def _interleaved_one_f_one_b(stage: InterleavedStage, step: int) -> float:
    """megatron-core's forward_backward_pipelining_with_interleaving: virtual micro-batch ``k``
    runs chunk ``(k // PP) % VIRTUAL`` forward (backward: the chunks in reverse) on micro-batch
    ``(k // (PP * VIRTUAL)) * PP + k % PP``; ``(PP - rank - 1) * 2 + (VIRTUAL - 1) * PP`` warm-up
    forwards, then one forward and one backward each, then the rest of the backwards. Every
    chunk is under no_sync except around the backward of a chunk's last micro-batch. Activations
    and gradients go point to point, tagged by virtual stage and micro-batch."""
    chunks, rank, total_virtual = stage.chunks, stage.pp_rank, MICRO_BATCHES * VIRTUAL
    last_stage = PP * VIRTUAL - 1
    sends, inputs, outputs, total = [], [[] for _ in chunks], [[] for _ in chunks], 0.0
    no_sync = contextlib.ExitStack()

    def disable_grad_sync() -> None:
        for chunk in chunks:
            no_sync.enter_context(chunk.no_sync())

    def micro_batch(k: int) -> int:
        return (k // (PP * VIRTUAL)) * PP + k % PP

    def forward(k: int) -> None:
        nonlocal total
        virtual = (k // PP) % VIRTUAL
        index, virtual_stage = micro_batch(k), virtual * PP + rank
        tokens, targets = _micro_batch(step, stage.dp_rank, index)
        if virtual_stage == 0:
            x = tokens
        else:
            x = torch.empty(MICRO_ROWS, SEQ, HIDDEN)
            dist.recv(x, src=stage.peer(rank - 1), tag=virtual_stage * 100 + index)
            x.requires_grad_(True)
        output = chunks[virtual](x, targets)
        if virtual_stage == last_stage:
            output = output / MICRO_BATCHES
            total += output.item()
        else:
            tag = (virtual_stage + 1) * 100 + index
            sends.append(dist.isend(output.detach().contiguous(), dst=stage.peer(rank + 1), tag=tag))
        inputs[virtual].append(x)
        outputs[virtual].append(output)

    def backward(k: int) -> None:
        virtual = VIRTUAL - 1 - (k // PP) % VIRTUAL
        index, virtual_stage = micro_batch(k), virtual * PP + rank
        last_for_chunk = k >= total_virtual - PP
        if last_for_chunk:
            no_sync.close()  # enable_grad_sync for the chunk's last micro-batch
        output, x = outputs[virtual].pop(0), inputs[virtual].pop(0)
        if virtual_stage == last_stage:
            output.backward()
        else:
            grad = torch.empty_like(output)
            dist.recv(grad, src=stage.peer(rank + 1), tag=10000 + virtual_stage * 100 + index)
            torch.autograd.backward(output, grad)
        if virtual_stage != 0:
            tag = 10000 + (virtual_stage - 1) * 100 + index
            sends.append(dist.isend(x.grad.contiguous(), dst=stage.peer(rank - 1), tag=tag))
        if last_for_chunk:
            disable_grad_sync()

    disable_grad_sync()
    _in_one_f_one_b_order(min((PP - rank - 1) * 2 + (VIRTUAL - 1) * PP, total_virtual), total_virtual, forward, backward)
    no_sync.close()
    for send in sends:
        send.wait()
    return total


def _interleaved_step(stage: InterleavedStage, step: int) -> tuple[float, float]:
    loss = torch.tensor(_interleaved_one_f_one_b(stage, step))
    for chunk in stage.chunks:  # finalize_model_grads: each chunk's sync, then the embedding group
        chunk.finish_grad_sync()
    _all_reduce_tied_weight_grad(stage.chunks[0] if stage.pp_rank == 0 else stage.chunks[-1], stage.pp_group)
    norm = megatron_core_clip(stage.optimizer, 0.5)
    stage.optimizer.step()
    for chunk in stage.chunks:
        chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()
        chunk.zero_grad_buffer()
    dist.all_reduce(loss)
    return loss.item() / DP, norm


def _adapters(stage: InterleavedStage) -> list[nn.Module]:
    """megatron-core's FullyShardedDataParallel over each chunk, as mcore_flow's checkpoint helpers take it."""
    adapters = []
    for chunk in stage.chunks:
        adapter = nn.Module()
        adapter.module = chunk
        adapters.append(adapter)
    return adapters


def _interleaved_flow(rank: int, world_size: int, checkpoint_dir: str, strategy: str) -> dict:
    with _as_megatron_core_runs_it():
        stage = InterleavedStage(strategy)
        stage_dir = f"{checkpoint_dir}/stage{stage.pp_rank}"
        history = [_interleaved_step(stage, step) for step in range(SAVED_AT)]
        dcp.save(fsdp_dtensor_chunks_state(_adapters(stage), stage.optimizer), checkpoint_id=stage_dir,
                 process_group=stage.dp_group)
        history += [_interleaved_step(stage, step) for step in range(SAVED_AT, STEPS)]
        full = {}
        for chunk in stage.chunks:
            for key, value in chunk.state_dict().items():
                copy = "#copy" if key.endswith("output_layer.weight") else ""  # the tied weight's last-stage copy
                full[reference_name(chunk.module, key.removeprefix("module.")) + copy] = value.full_tensor()
        resumed = InterleavedStage(strategy)
        load_fsdp_dtensor(_adapters(resumed), resumed.optimizer, stage_dir)
        return {
            "history": history,
            "full": full,
            "resumed": [_interleaved_step(resumed, step) for step in range(SAVED_AT, STEPS)],
        }


def test_interleaved_chunks_train_like_one_process_with_tied_embedding_and_resume_exactly(tmp_path):
    results = run_distributed(_interleaved_flow, PP * DP, str(tmp_path / "ckpt"), "optim_grads_params")
    reference_params = _history_like_one_process(results)
    held = results[0]["full"] | results[PP * DP - 1]["full"]
    tied = "embedding.word_embeddings.weight"
    assert torch.equal(held[tied], held.pop(tied + "#copy")), "the tied copies drifted apart"
    assert held.keys() == reference_params.keys()
    for name, expected in reference_params.items():
        torch.testing.assert_close(held[name], expected, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
    for result in results:
        assert result["resumed"] == result["history"][SAVED_AT:], f"resumed {result['resumed']} vs {result['history']}"


def test_megatron_lm_fsdp_dtensor_checkpoints_under_pipeline_parallelism_are_refused_before_training() -> None:
    """Megatron-LM keys fsdp_dtensor tensors by stage-local layer names: a PP > 1 save would keep
    one stage's layers. Refused by the wrapper's constructor, from Megatron-LM's own arguments."""
    from types import SimpleNamespace

    from megatron_fsdp.integrations.mcore_pipeline import refuse_pipeline_checkpoints

    saving = SimpleNamespace(ckpt_format="fsdp_dtensor", save="/ckpt", load=None)
    with pytest.raises(ValueError, match="--save with --ckpt-format fsdp_dtensor at --pipeline-model-parallel-size 2: "):
        refuse_pipeline_checkpoints(2, saving)
    with pytest.raises(ValueError, match="--save and --load with .* Checkpoint at pipeline-parallel size 1"):
        refuse_pipeline_checkpoints(4, SimpleNamespace(ckpt_format="fsdp_dtensor", save="/ckpt", load="/ckpt"))
    refuse_pipeline_checkpoints(1, saving)  # one stage holds every layer under its own name
    refuse_pipeline_checkpoints(2, SimpleNamespace(ckpt_format="torch_dist", save="/ckpt", load=None))  # global offsets
    refuse_pipeline_checkpoints(2, SimpleNamespace(ckpt_format="fsdp_dtensor", save=None, load=None))  # nothing saved
    refuse_pipeline_checkpoints(2, None)  # not under a Megatron-LM script
