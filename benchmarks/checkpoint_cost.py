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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import megatron_fsdp  # noqa: E402
from gpt_model import GPT, GPTConfig, TransformerBlock  # noqa: E402
from megatron_fsdp import _ops  # noqa: E402
from megatron_fsdp.checkpoint_integrity import checksum_segments, verify_checkpoint  # noqa: E402

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


def measure_model(name: str, config: GPTConfig, note: str, directory: str, reps: int, device: torch.device) -> dict:
    model, optimizer = _build(config, device)
    times: dict[str, list[float]] = {key: [] for key in (
        "save_without_checksums", "save_with_checksums", "load_unverified_warm", "load_verified_warm",
        "load_unverified_cold", "load_verified_cold", "checksum_all_files_warm", "verify_warm")}
    plain_dir, checked_dir = os.path.join(directory, "plain"), os.path.join(directory, "checked")
    # Untimed: the first save and load allocate pinned staging memory and warm DCP's planner.
    megatron_fsdp.save_checkpoint(checked_dir, 1, model, optimizer)
    megatron_fsdp.load_checkpoint(checked_dir, model, optimizer)
    checkpoint_bytes = 0
    for rep in range(reps):
        shutil.rmtree(checked_dir, ignore_errors=True)
        for checksums in (False, True) if rep % 2 == 0 else (True, False):  # alternate which save goes first
            if checksums:
                times["save_with_checksums"].append(_timed(lambda: megatron_fsdp.save_checkpoint(checked_dir, 1, model, optimizer)))
            else:
                times["save_without_checksums"].append(_timed(lambda: _save_without_checksums(plain_dir, 1, model, optimizer)))
                shutil.rmtree(plain_dir)  # one checkpoint on the disk at a time
        path = os.path.join(checked_dir, "step_00000001")
        checkpoint_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        times["checksum_all_files_warm"].append(_timed(lambda: _checksum_all(path)))
        times["verify_warm"].append(_timed(lambda: verify_checkpoint(path, 1)))
        times["load_unverified_warm"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer, verify=False)))
        times["load_verified_warm"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer)))
        _drop_from_page_cache(path)
        times["load_unverified_cold"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer, verify=False)))
        _drop_from_page_cache(path)
        times["load_verified_cold"].append(_timed(lambda: megatron_fsdp.load_checkpoint(checked_dir, model, optimizer)))
        print(f"{name} rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    shutil.rmtree(checked_dir, ignore_errors=True)
    medians = {key: statistics.median(values) for key, values in times.items()}
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "config": name,
        "size": note,
        "layers": config.layers,
        "parameters": _parameters(config),
        "checkpoint_bytes": checkpoint_bytes,
        "median_s": medians,
        "all_s": times,
        "save_overhead_pct": 100 * (medians["save_with_checksums"] / medians["save_without_checksums"] - 1),
        # The checksums' own time against the plain save: the overhead without the noise of two saves.
        "checksum_share_of_save_pct": 100 * medians["checksum_all_files_warm"] / medians["save_without_checksums"],
        "load_overhead_warm_pct": 100 * (medians["load_verified_warm"] / medians["load_unverified_warm"] - 1),
        "load_overhead_cold_pct": 100 * (medians["load_verified_cold"] / medians["load_unverified_cold"] - 1),
        "checksum_GB_per_s_page_cache": checkpoint_bytes / medians["checksum_all_files_warm"] / 1e9,
    }


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
    }
    crc = measure_crc32c(args.crc_bytes, iters=5)
    print(json.dumps(crc, indent=1), flush=True)
    rows = []
    try:
        for name in args.configs.split(","):
            config, note = (CONFIGS[name], "full size") if name != "8B" else _fitting(CONFIGS[name], args.dir, args.layers_8b)
            print(f"{name}: {config.layers} layers, {_parameters(config) / 1e9:.2f} B parameters ({note})", flush=True)
            rows.append(measure_model(name, config, note, args.dir, args.reps, device))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    setting["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    with open(args.out, "w") as handle:
        json.dump({"setting": setting, "crc32c": crc, "models": rows}, handle, indent=2)

    print(f"{setting['device']}, torch {setting['torch']}, {setting['date']}, {setting['torch_threads']} threads")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
