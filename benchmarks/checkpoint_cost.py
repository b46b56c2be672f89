"""What checksummed checkpoints cost: save and load time of the benchmark GPTs with and without
checksums (one GPU, world size 1), and the crc32c op's throughput against memory bandwidth.

    python benchmarks/checkpoint_cost.py --out results.json [--dir /fast/disk/tmp] [--configs 1.3B,8B]

Per model (examples/gpt_model.py, the sizes of benchmarks/step_time.py; bf16 compute weights,
fp32 main weights, AdamW state), each a median of --reps repetitions:

- save: the save as it was before checksums (``dcp.save`` into ``step_<N>.partial``, rename)
  against ``save_checkpoint`` (the same plus the checksums, read back from the page cache, and
  the manifest);
- load: ``load_checkpoint(verify=False)`` against ``load_checkpoint`` (verification first), with
  the files in the page cache (right after the save) and cold (dropped from the cache with
  ``posix_fadvise(DONTNEED)``, no root needed);
- checksum and verify alone: checksumming every file of the checkpoint, and ``verify_checkpoint``.

The 8B model's checkpoint (fp32 weights and two Adam moments: 12 bytes per parameter, 96 GB) is
larger than the disk of the benchmark machines (64 GiB) and, with bf16 weights and gradients,
close to one H200's memory: unless --layers-8b says otherwise, the 8B case keeps the 8B model's
width (hidden 4096, ffn 14336, vocab 128256) and as many of its 32 layers as fit in 70% of the
free disk and 80% of the free GPU memory; the JSON records the layers and parameters used.
Save and load times scale with the bytes, so the relative overheads carry over.

--save-compare also compares three ways of saving model and optimizer state with ``dcp.save``
(no checksums), each a median of --reps repetitions of wall time and of the peak device memory
the save adds (``max_memory_allocated`` after ``reset_peak_memory_stats`` right before the
save, less what was allocated before it; the same for reserved memory):

1. ``megatron_fsdp_state_dict``: megatron_fsdp's zero-copy state dicts,
   ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` (the "save without
   checksums" above, timed once for both);
2. ``megatron_fsdp_get_state_dict``: the same objects through torch's helpers,
   ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` (timed with it);
3. ``fsdp2_get_state_dict``: torch FSDP2 on the same GPT, seed and size (fp32 parameters,
   ``fully_shard`` per TransformerBlock and on the root with a bf16/fp32 MixedPrecisionPolicy,
   benchmarks/step_time.py's builder; fused AdamW with its state made by one step on a
   batch of 8 tokens), built after the megatron_fsdp model is freed, saved as in 2.

Every way writes into ``step_<N>.partial`` and renames, one checkpoint on the disk at a time.
``--save-compare on`` adds the comparison to the measurements above; ``--save-compare only``
measures the three saves alone (no checksummed saves, loads, warm-up save or crc32c timings:
each save is disk-bound, about 0.75 GB/s on the H100 machine, so this is what fits in minutes):

    python benchmarks/checkpoint_cost.py --out save_compare.json --save-compare only --reps 2 --layers-8b 3
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_time, also under python -m
import megatron_fsdp  # noqa: E402
from gpt_model import GPT, GPTConfig, TransformerBlock  # noqa: E402
from megatron_fsdp import _ops  # noqa: E402
from megatron_fsdp.checkpoint.integrity import checksum_segments, verify_checkpoint  # noqa: E402
from step_time import _fsdp2_with  # noqa: E402

CONFIGS = {
    "1.3B": GPTConfig(vocab_size=32000, seq_len=2048, layers=24, hidden=2048, heads=16, ffn=5632),
    "8B": GPTConfig(vocab_size=128256, seq_len=4096, layers=32, hidden=4096, heads=32, ffn=14336),
}
# Bytes per parameter: on disk (fp32 weights, exp_avg, exp_avg_sq) and on the GPU (those, bf16
# compute weights and bf16 main gradients while the optimizer state is created).
DISK_BYTES_PER_PARAM, GPU_BYTES_PER_PARAM = 12, 16


def _parameters(config: GPTConfig) -> int:
    per_layer = 4 * config.hidden * config.hidden + 3 * config.hidden * config.ffn + 2 * config.hidden
    return config.layers * per_layer + 2 * config.vocab_size * config.hidden + config.seq_len * config.hidden + config.hidden


def _fitting(config: GPTConfig, directory: str, layers: int | None) -> tuple[GPTConfig, str]:
    """``config`` with as many layers as fit on the disk and the GPU (or ``layers``), and why."""
    if layers is not None:
        return dataclasses.replace(config, layers=layers), f"--layers-8b {layers}"
    free_disk = shutil.disk_usage(directory).free
    free_gpu = torch.cuda.mem_get_info()[0]
    fits = config
    while fits.layers > 1 and (
        _parameters(fits) * DISK_BYTES_PER_PARAM > 0.7 * free_disk or _parameters(fits) * GPU_BYTES_PER_PARAM > 0.8 * free_gpu
    ):
        fits = dataclasses.replace(fits, layers=fits.layers - 1)
    if fits.layers == config.layers:
        return fits, "full size"
    return fits, (f"{fits.layers} of {config.layers} layers: the full model's checkpoint "
                  f"({_parameters(config) * DISK_BYTES_PER_PARAM / 1e9:.0f} GB) does not fit in 70% of the free disk "
                  f"({free_disk / 1e9:.0f} GB) or its state in 80% of the free GPU memory ({free_gpu / 1e9:.0f} GB)")


def _build(config: GPTConfig, device: torch.device):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.bfloat16)
    model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[TransformerBlock],
                                                 zero_dp_strategy="optim_grads_params", mixed_precision_policy=policy)
    optimizer.state_dict()  # creates the Adam state (a zero-learning-rate step) before anything is timed
    return model, optimizer


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def _save_without_checksums(directory: str, step: int, model, optimizer) -> None:
    """What save_checkpoint did before manifests: DCP into a partial directory, then a rename."""
    final = os.path.join(directory, f"step_{step:08d}")
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=final + ".partial")
    os.rename(final + ".partial", final)


def _save_through_helpers(directory: str, step: int, model, optimizer) -> None:
    """As _save_without_checksums, with the state dicts from torch's get_state_dict (the way
    torchtitan-style trainers save; it works on megatron_fsdp's objects and on FSDP2's)."""
    final = os.path.join(directory, f"step_{step:08d}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=final + ".partial")
    os.rename(final + ".partial", final)


@dataclasses.dataclass
class SaveCost:
    seconds: float
    extra_allocated: int  # peak allocated during the save less what was allocated right before
    extra_reserved: int  # the same for memory reserved by the caching allocator
    allocated_before: int  # the model and optimizer state (and anything else resident)


def _timed_save(fn: Callable[[], object]) -> SaveCost:
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    seconds = _timed(fn)
    return SaveCost(seconds, torch.cuda.max_memory_allocated() - allocated, torch.cuda.max_memory_reserved() - reserved, allocated)


def _oom_message(error: torch.OutOfMemoryError) -> str:
    return "out of memory: " + str(error).split("See documentation")[0].strip()


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


@dataclasses.dataclass
class _SaveWay:
    """One way of saving, measured over the repetitions; with catch_oom, running out of device
    memory ends this way's measurement (recorded) instead of the whole run."""

    catch_oom: bool
    costs: list[SaveCost] = dataclasses.field(default_factory=list)
    checkpoint_bytes: int = 0
    error: str | None = None

    def measure(self, directory: str, save: Callable[[str], object]) -> SaveCost | None:
        """Times ``save(directory)``, which writes step 1 there, then removes the directory (one
        checkpoint on the disk at a time)."""
        if self.error is not None:
            return None
        try:
            cost = _timed_save(lambda: save(directory))
            self.checkpoint_bytes = _directory_bytes(os.path.join(directory, "step_00000001"))
            self.costs.append(cost)
            return cost
        except torch.OutOfMemoryError as error:
            if not self.catch_oom:
                raise
            self.error = _oom_message(error)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        # Outside the except block, so the traceback's frames (and their tensors) are gone.
        gc.collect()
        torch.cuda.empty_cache()
        return None

    def summary(self) -> dict:
        gib = 2**30
        row: dict = {}
        if self.costs:
            row = {
                "median_s": statistics.median(c.seconds for c in self.costs),
                "all_s": [c.seconds for c in self.costs],
                "peak_extra_allocated_gib": statistics.median(c.extra_allocated for c in self.costs) / gib,
                "all_peak_extra_allocated_gib": [c.extra_allocated / gib for c in self.costs],
                "peak_extra_reserved_gib": statistics.median(c.extra_reserved for c in self.costs) / gib,
                "all_peak_extra_reserved_gib": [c.extra_reserved / gib for c in self.costs],
                "allocated_before_gib": statistics.median(c.allocated_before for c in self.costs) / gib,
                "checkpoint_bytes": self.checkpoint_bytes,
            }
        if self.error is not None:
            row["error"] = self.error
        return row


def _build_fsdp2(config: GPTConfig, device: torch.device):
    """torch FSDP2 as benchmarks/step_time.py builds it (fp32 parameters, fully_shard per block
    and on the root, bf16 compute, fp32 reduction, fused AdamW), the AdamW state made by one
    training step on 8 tokens: the state a training job would save."""
    model, optimizer, _ = _fsdp2_with(offload=False)(config, device)
    tokens = torch.randint(0, config.vocab_size, (1, 9), device=device, generator=torch.Generator(device).manual_seed(0))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # fp32 gradients would add 4 bytes per parameter
    return model, optimizer


def measure_fsdp2_save(config: GPTConfig, directory: str, reps: int, device: torch.device) -> dict:
    """Way 3 of --save-compare: get_state_dict and dcp.save of FSDP2's model and AdamW."""
    # The megatron_fsdp model sits in reference cycles (hooks): collect it before building this one.
    gc.collect()
    torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gib = 2**30
    error = None
    try:
        model, optimizer = _build_fsdp2(config, device)
    except torch.OutOfMemoryError as oom:
        error = _oom_message(oom)
    if error is not None:
        gc.collect()
        torch.cuda.empty_cache()
        return {"error": error, "leftover_allocated_gib": leftover / gib}
    build_peak = torch.cuda.max_memory_allocated()
    way = _SaveWay(catch_oom=True)
    for rep in range(reps):
        cost = way.measure(directory, lambda path: _save_through_helpers(path, 1, model, optimizer))
        print(f"FSDP2 rep {rep + 1}/{reps}: " + (f"save {cost.seconds:.2f} s, +{cost.extra_allocated / gib:.2f} GiB allocated"
                                                  if cost else str(way.error)), flush=True)
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return {**way.summary(), "build_peak_allocated_gib": build_peak / gib, "leftover_allocated_gib": leftover / gib}


def _drop_from_page_cache(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _checksum_all(path: str) -> int:
    """Checksums every file of the checkpoint, as save_checkpoint does (whole files here)."""
    total = 0
    for name in os.listdir(path):
        total += checksum_segments(os.path.join(path, name), [])["size"]
    return total


def measure_model(name: str, config: GPTConfig, note: str, directory: str, reps: int, device: torch.device,
                  save_compare: str = "off") -> dict:
    checksum_cost = save_compare != "only"  # the checksummed saves and the loads
    model, optimizer = _build(config, device)
    times: dict[str, list[float]] = {key: [] for key in ("save_without_checksums",) + ((
        "save_with_checksums", "load_unverified_warm", "load_verified_warm",
        "load_unverified_cold", "load_verified_cold", "checksum_all_files_warm", "verify_warm") if checksum_cost else ())}
    plain_dir, checked_dir, helpers_dir = (os.path.join(directory, d) for d in ("plain", "checked", "helpers"))
    zero_copy, helpers = _SaveWay(catch_oom=False), _SaveWay(catch_oom=True)

    def zero_copy_save() -> None:
        cost = zero_copy.measure(plain_dir, lambda path: _save_without_checksums(path, 1, model, optimizer))
        times["save_without_checksums"].append(cost.seconds)

    def helpers_save() -> None:
        helpers.measure(helpers_dir, lambda path: _save_through_helpers(path, 1, model, optimizer))

    def checksummed_save_and_loads() -> int:
        """The checksummed save, then the loads and checks of it; removes it; returns its bytes."""
        times["save_with_checksums"].append(_timed(lambda: megatron_fsdp.save_checkpoint(checked_dir, 1, model, optimizer)))
        path = os.path.join(checked_dir, "step_00000001")
        nbytes = _directory_bytes(path)
        times["checksum_all_files_warm"].append(_timed(lambda: _checksum_all(path)))
        times["verify_warm"].append(_timed(lambda: verify_checkpoint(path, 1)))
        times["load_unverified_warm"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer, verify=False)))
        times["load_verified_warm"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer)))
        _drop_from_page_cache(path)
        times["load_unverified_cold"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer, verify=False)))
        _drop_from_page_cache(path)
        times["load_verified_cold"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer)))
        shutil.rmtree(checked_dir)
        return nbytes

    # Saves that leave nothing on the disk, in this order on even repetitions, reversed on odd ones.
    others: list[Callable[[], None]] = [zero_copy_save] + ([helpers_save] if save_compare != "off" else [])
    if checksum_cost:
        # Untimed: the first save and load allocate pinned staging memory and warm DCP's planner.
        megatron_fsdp.save_checkpoint(checked_dir, 1, model, optimizer)
        megatron_fsdp.load_checkpoint(checked_dir, model, optimizer)
        shutil.rmtree(checked_dir)
    checkpoint_bytes = 0
    for rep in range(reps):
        # Alternate which save goes first; the checksummed checkpoint is loaded right after its
        # save and removed before the next save, so one checkpoint is on the disk at a time (the
        # 8B case is sized to 70% of the free disk).
        if rep % 2 == 0:
            for save in others:
                save()
        if checksum_cost:
            checkpoint_bytes = checksummed_save_and_loads()
        if rep % 2 == 1:
            for save in reversed(others):
                save()
        if not checksum_cost:
            checkpoint_bytes = zero_copy.checkpoint_bytes
        line = ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items())
        if save_compare != "off":
            line += f", get_state_dict save {helpers.costs[-1].seconds:.2f} s" if helpers.error is None else f", {helpers.error}"
        print(f"{name} rep {rep + 1}/{reps}: {line}", flush=True)
    shutil.rmtree(checked_dir, ignore_errors=True)
    medians = {key: statistics.median(values) for key, values in times.items()}
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    row = {
        "config": name,
        "size": note,
        "layers": config.layers,
        "parameters": _parameters(config),
        "checkpoint_bytes": checkpoint_bytes,
        "median_s": medians,
        "all_s": times,
    }
    if checksum_cost:
        row.update({
            "save_overhead_pct": 100 * (medians["save_with_checksums"] / medians["save_without_checksums"] - 1),
            # The checksums' own time against the plain save: the overhead without the noise of two saves.
            "checksum_share_of_save_pct": 100 * medians["checksum_all_files_warm"] / medians["save_without_checksums"],
            "load_overhead_warm_pct": 100 * (medians["load_verified_warm"] / medians["load_unverified_warm"] - 1),
            "load_overhead_cold_pct": 100 * (medians["load_verified_cold"] / medians["load_unverified_cold"] - 1),
            "checksum_GB_per_s_page_cache": checkpoint_bytes / medians["checksum_all_files_warm"] / 1e9,
        })
    if save_compare != "off":
        # After the megatron_fsdp model is freed: both must fit on one GPU, one at a time.
        ways = {
            "megatron_fsdp_state_dict": zero_copy.summary(),
            "megatron_fsdp_get_state_dict": helpers.summary(),
            "fsdp2_get_state_dict": measure_fsdp2_save(config, os.path.join(directory, "fsdp2"), reps, device),
        }
        base = ways["megatron_fsdp_state_dict"]["median_s"]
        row["save_compare"] = {
            **ways,
            "time_vs_megatron_fsdp_state_dict": {k: w["median_s"] / base for k, w in ways.items() if "median_s" in w},
        }
    return row


def _median_s(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_crc32c(nbytes: int, iters: int) -> dict:
    """The op on a host buffer, all threads and one, against host copy bandwidth (torch copy_, bytes
    read plus written, as benchmarks/op_bandwidth.py counts) and read bandwidth (a sum)."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    copy_target = torch.empty_like(data)
    words = data.view(torch.int64)
    threads = torch.get_num_threads()
    result = {
        "bytes": nbytes,
        "threads": threads,
        "crc32c_GB_per_s": nbytes / _median_s(lambda: _ops.crc32c(data), iters) / 1e9,
        "host_copy_GB_per_s_read_plus_write": 2 * nbytes / _median_s(lambda: copy_target.copy_(data), iters) / 1e9,
        "host_read_GB_per_s_sum": nbytes / _median_s(lambda: words.sum(), iters) / 1e9,
    }
    torch.set_num_threads(1)
    try:
        result["crc32c_GB_per_s_one_thread"] = nbytes / _median_s(lambda: _ops.crc32c(data), iters) / 1e9
    finally:
        torch.set_num_threads(threads)
    source = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    target.copy_(source)
    start.record()
    for _ in range(iters):
        target.copy_(source)
    end.record()
    end.synchronize()
    result["device_copy_GB_per_s_read_plus_write"] = 2 * nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9
    return result


def _init_single_process_group(device: torch.device) -> None:
    if "RANK" not in os.environ:  # run with plain python: a world of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=device)
    if dist.get_world_size() != 1:
        raise SystemExit("checkpoint_cost.py measures one GPU: run it with plain python, not torchrun")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the results as JSON here")
    parser.add_argument("--dir", default="checkpoint_cost_tmp",
                        help="where the checkpoints go (a real disk, not tmpfs); emptied and removed at the end")
    parser.add_argument("--configs", default="1.3B,8B", help="comma-separated: 1.3B, 8B")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each save and load; medians are reported")
    parser.add_argument("--layers-8b", type=int, default=None, help="layers of the 8B case (default: as many as fit)")
    parser.add_argument("--crc-bytes", type=int, default=1 << 30, help="host buffer size of the crc32c measurement")
    parser.add_argument("--save-compare", choices=("off", "on", "only"), default="off",
                        help="also compare the zero-copy save with get_state_dict saves of megatron_fsdp and FSDP2 "
                             "('on'), or measure only that ('only'); see the module docstring")
    args = parser.parse_args()

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    _init_single_process_group(device)
    os.makedirs(args.dir, exist_ok=True)
    setting = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "checkpoint_dir": os.path.abspath(args.dir),
        "free_disk_bytes": shutil.disk_usage(args.dir).free,
        "reps": args.reps,
        "save_compare": args.save_compare,
    }
    crc = None
    if args.save_compare != "only":
        crc = measure_crc32c(args.crc_bytes, iters=5)
        print(json.dumps(crc, indent=1), flush=True)
    rows = []

    def write() -> None:
        setting["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        with open(args.out, "w") as handle:
            json.dump({"setting": setting, "crc32c": crc, "models": rows}, handle, indent=2)

    try:
        for name in args.configs.split(","):
            config, note = (CONFIGS[name], "full size") if name != "8B" else _fitting(CONFIGS[name], args.dir, args.layers_8b)
            print(f"{name}: {config.layers} layers, {_parameters(config) / 1e9:.2f} B parameters ({note})", flush=True)
            rows.append(measure_model(name, config, note, args.dir, args.reps, device, args.save_compare))
            write()  # after each model, so a run cut short keeps the models it finished
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    write()

    print(f"{setting['device']}, torch {setting['torch']}, {setting['date']}, {setting['torch_threads']} threads")
    if crc is not None:
        _print_checksum_table(rows, crc)
    if args.save_compare != "off":
        _print_save_compare_table(rows)
    dist.destroy_process_group()


def _print_checksum_table(rows: list[dict], crc: dict) -> None:
    print("| model | params | checkpoint GB | save s (plain / checksummed, +%) | checksums alone, % of save "
          "| load warm s (unverified / verified, +%) | load cold s (+%) | checksum GB/s |")
    print("| --- | ---: | ---: | --- | ---: | --- | --- | ---: |")
    for row in rows:
        m = row["median_s"]
        print(f"| {row['config']} ({row['layers']} layers) | {row['parameters'] / 1e9:.2f} B | {row['checkpoint_bytes'] / 1e9:.1f} "
              f"| {m['save_without_checksums']:.2f} / {m['save_with_checksums']:.2f} ({row['save_overhead_pct']:+.1f}%) "
              f"| {row['checksum_share_of_save_pct']:.1f} "
              f"| {m['load_unverified_warm']:.2f} / {m['load_verified_warm']:.2f} ({row['load_overhead_warm_pct']:+.1f}%) "
              f"| {m['load_unverified_cold']:.2f} / {m['load_verified_cold']:.2f} ({row['load_overhead_cold_pct']:+.1f}%) "
              f"| {row['checksum_GB_per_s_page_cache']:.1f} |")
    print(f"crc32c: {crc['crc32c_GB_per_s']:.1f} GB/s ({crc['crc32c_GB_per_s_one_thread']:.1f} on one thread); host copy "
          f"{crc['host_copy_GB_per_s_read_plus_write']:.1f} GB/s (read+write), host read {crc['host_read_GB_per_s_sum']:.1f} GB/s, "
          f"device copy {crc['device_copy_GB_per_s_read_plus_write']:.0f} GB/s")


def _print_save_compare_table(rows: list[dict]) -> None:
    ways = (("megatron_fsdp_state_dict", "megatron_fsdp state_dict"), ("megatron_fsdp_get_state_dict", "megatron_fsdp get_state_dict"),
            ("fsdp2_get_state_dict", "FSDP2 get_state_dict"))
    print("| model | save | median s | vs zero-copy | peak extra allocated GiB | peak extra reserved GiB "
          "| allocated before GiB | checkpoint GB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        compare = row["save_compare"]
        for key, label in ways:
            w = compare[key]
            model = f"{row['config']} ({row['layers']} layers, {row['parameters'] / 1e9:.2f} B)"
            if "median_s" not in w:
                print(f"| {model} | {label} | {w.get('error', '?')} | | | | | |")
                continue
            print(f"| {model} | {label} | {w['median_s']:.2f} | {compare['time_vs_megatron_fsdp_state_dict'][key]:.2f} "
                  f"| {w['peak_extra_allocated_gib']:.2f} | {w['peak_extra_reserved_gib']:.2f} | {w['allocated_before_gib']:.1f} "
                  f"| {w['checkpoint_bytes'] / 1e9:.1f} |" + (f" ({w['error']})" if "error" in w else ""))


if __name__ == "__main__":
    main()
