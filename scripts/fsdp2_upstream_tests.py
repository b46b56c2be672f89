"""Runs PyTorch's own FSDP2 test files against megatron_fsdp.fsdp2 on the CPU over gloo.

The test files are not part of this project (nor of the torch wheel): fetch
``test/distributed/_composable/fsdp/`` (or ``test_composability/test_2d_composability.py``,
FSDP2 x TP) of pytorch/pytorch into a directory and pass it::

    .venv/bin/python scripts/fsdp2_upstream_tests.py /tmp/fsdp2_upstream \\
        --files test_fully_shard_training.py --report /tmp/fsdp2_upstream_report.md

The files run unedited and torch's library is not patched. Each test module is imported, and the
names bound to torch's ``fully_shard`` are rebound to ours: in that module's namespace, and in
torch's test helpers it uses (``torch.testing._internal.*``, where ``MLPStack.parallelize`` calls
``fully_shard``); ``torch.distributed.fsdp.fully_shard`` itself stays torch's. Ours is rebound
through a wrapper that counts its calls: a test that passes without one did not test ours and is
counted apart. Each test method runs on its own gloo ranks (forked processes; the module is
already imported), the way torch's ``FSDPTest`` (or ``MultiProcContinuousTest``) runs it, but
launched here: torch's launchers tie the world size to the number of accelerators. ``skip_if_lt_x_gpu`` gates without ``allow_cpu`` are stepped over
(the body underneath runs) because most of those bodies only name the device through
``get_devtype()``; a body that really needs CUDA then fails, and is reported as such.

Every test is reported passed, failed (with a reason class), skipped or timed out.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import inspect
import multiprocessing
import os
import re
import socket
import sys
import time
import traceback
import types
import unittest
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.fsdp

import megatron_fsdp.fsdp2 as ours

# Failures that say this CPU build lacks what the test needs, whatever the exception's type; tried
# first (torch's DTensor raises NotImplementedError for the CPU flash-attention op it has no
# sharding rule for: on CUDA, SDPA takes kernels it has one for).
CPU_BUILD_NEEDLES = (
    "_for_cpu.default does not have a sharding strategy",
    "FSDP needs a non-CPU accelerator device",
    "Cannot access accelerator device when none is available",
    "device_ids and output_device arguments only work with single-device/multiple-device GPU modules",
)

# Reason classes, tried in order on a failing rank's traceback (the first that matches wins).
REASON_PATTERNS: list[tuple[str, tuple[str, ...]]] = [
    ("needs CUDA", ("Torch not compiled with CUDA", "torch.cuda", "CUDAGraph", "device_sleep", "cuda")),
    (
        "tests torch internals",
        (
            "_get_fsdp_state",
            "_fsdp_param_group",
            "FSDPParamGroup",
            "RegisterPostBackwardFunction",
            "_comm_ctx",
            "share_comm_ctx",
            "register_fsdp_forward_method",
            "foreach_all_gather",
            "foreach_reduce",
            "_modules_to_run_forward",
        ),
    ),
    ("refused by design (clear error)", ("NotImplementedError",)),
]

# The reason of a failure that matches no class above, in a test that never called our fully_shard.
NEVER_CALLED = "our fully_shard never called"

# Calls of our fully_shard in this process (a forked rank starts at 0).
_our_calls = 0


@functools.wraps(ours.fully_shard)
def _counted_fully_shard(*args, **kwargs):
    global _our_calls
    _our_calls += 1
    return ours.fully_shard(*args, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_test_module(path: Path, rebind: bool = True) -> tuple[types.ModuleType, list[str]]:
    """Imports one upstream test file and rebinds the torch ``fully_shard`` names of it and of
    torch's test helpers to ours (``rebind=False``: leaves torch's, for a baseline of torch's own
    FSDP2 on this machine). Returns the module and the names rebound."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    rebound = []
    helpers = [(name, mod) for name, mod in sys.modules.items() if name.startswith("torch.testing._internal.") and mod]
    for prefix, namespace in [("", module)] + [(f"{name.rsplit('.', 1)[-1]}.", mod) for name, mod in helpers]:
        for name, value in list(vars(namespace).items()):
            if rebind and value is torch.distributed.fsdp.fully_shard:
                setattr(namespace, name, _counted_fully_shard)
                rebound.append(prefix + name)
    return module, rebound


def test_cases(module) -> list[tuple[type, str]]:
    cases = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if not issubclass(cls, unittest.TestCase) or cls.__module__ != module.__name__:
            continue
        cases += [(cls, name) for name in sorted(dir(cls)) if name.startswith("test")]
    return cases


def _qualname(fn: Callable) -> str:
    # functools.wraps copies the test's name onto a wrapper; its code keeps the wrapper's.
    return getattr(getattr(fn, "__code__", None), "co_qualname", "")


def _body(cls: type, method: str) -> tuple[Callable, bool]:
    """The test function, with a GPU-count gate stepped over (see the module docstring), and
    whether there was one."""
    fn = getattr(cls, method)
    gated = False
    params: dict = {}
    if "instantiated_test" in _qualname(fn):
        # instantiate_parametrized_tests' wrapper calls the (gated) test with its parameters,
        # which it holds as its default argument.
        params, fn = fn.__defaults__[0], fn.__wrapped__
    while "skip_if_lt_x_gpu" in _qualname(fn):
        fn, gated = fn.__wrapped__, True
    return (functools.partial(fn, **params) if params else fn), gated


def _harness_class(cls: type, world_size: int) -> type:
    """``cls`` with the world size this run uses and a plain, settable rank."""

    def get_rank(self):
        return self.__dict__.get("_harness_rank", -1)

    def set_rank(self, value):
        self.__dict__["_harness_rank"] = value

    return type(cls.__name__, (cls,), {"world_size": property(lambda self: world_size), "rank": property(get_rank, set_rank)})


def _rank_main(cls, method, rank, world_size, port, log_path, conn) -> None:
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    try:
        from torch.testing._internal.common_utils import set_rng_seed

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        instance = _harness_class(cls, world_size)(method)
        instance.rank = rank
        instance.file_name = str(log_path)
        torch._dynamo.reset()
        set_rng_seed()
        fn, _ = _body(cls, method)
        fn(instance)
        conn.send(("passed", "", _our_calls))
    except unittest.SkipTest as skip:
        conn.send(("skipped", str(skip), _our_calls))
    except SystemExit as exit_:
        conn.send(("skipped", f"exit code {exit_.code}", _our_calls))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        conn.send(("failed", traceback.format_exc(), _our_calls))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def classify(trace: str, ours_never_called: bool = False) -> str:
    """The reason class of a failing rank's traceback. ``ours_never_called``: the test failed
    without calling our fully_shard, so the failure is not of our FSDP2, unless a class above
    says more."""
    last_line = trace.strip().splitlines()[-1] if trace.strip() else ""
    if any(needle in trace for needle in CPU_BUILD_NEEDLES):
        return "needs CUDA"
    if last_line.startswith("NotImplementedError"):
        return "refused by design (clear error)"
    for reason, needles in REASON_PATTERNS:
        if any(needle in trace for needle in needles):
            return reason
    if ours_never_called:
        return NEVER_CALLED
    return "assertion or error: possible defect of ours"


def _world_size(cls: type, method: str) -> int:
    """The ranks a test asks for. torch's base classes answer with the accelerator count (0 or 1
    on a CPU build): at least 2 then. A class of the test file that sets its own world size (1
    included: FSDP2 at world size 1 runs no collective, which the test counts) gets it."""
    declared = cls(method).world_size
    own = [vars(klass)["world_size"] for klass in cls.__mro__ if klass.__module__ == cls.__module__ and "world_size" in vars(klass)]
    if own and isinstance(own[0], property):
        # ``min(8, torch.get_device_module(device_type).device_count())`` reads 1 on a CPU build
        # (the CPU module counts one device): such a class asks for its upper bound instead.
        source = inspect.getsource(own[0].fget)
        if "device_count" in source:
            bound = re.search(r"min\(\s*(\d+)", source)
            return int(bound.group(1)) if bound else max(declared, 2)
    return declared if own and declared >= 1 else max(declared, 2)


def run_case(cls, method, world_size, timeout, log_dir: Path) -> tuple[str, str, int]:
    """Runs one test method on ``world_size`` forked gloo ranks: its status, the first failing
    (or timed out, or skipped) rank's detail, and the most calls of our fully_shard on a rank."""
    context = multiprocessing.get_context("fork")
    port = _free_port()
    log_path = log_dir / f"{cls.__name__}.{method}.log"
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = context.Pipe(duplex=False)
        proc = context.Process(target=_rank_main, args=(cls, method, rank, world_size, port, log_path, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    deadline = time.monotonic() + timeout
    results = []
    for pipe in pipes:
        if pipe.poll(max(0.0, deadline - time.monotonic())):
            try:
                results.append(pipe.recv())
            except EOFError:
                results.append(("failed", "rank died without a result", 0))
        else:
            results.append(("timeout", f"no result within {timeout} s", 0))
    for proc in procs:
        proc.join(1)
        if proc.is_alive():
            proc.kill()
            proc.join()
    our_calls = max(calls for _, _, calls in results)
    for status in ("failed", "timeout", "skipped"):
        for result_status, detail, _ in results:
            if result_status == status:
                return status, detail, our_calls
    return "passed", "", our_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--files", nargs="*", help="test files to run (default: every test_*.py)")
    parser.add_argument("-k", dest="pattern", default="", help="run only tests whose Class.method contains this")
    parser.add_argument("--max-world-size", type=int, default=4, help="cap on ranks per test (2 CPU cores here)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per test method")
    parser.add_argument("--report", type=Path, default=Path("fsdp2_upstream_report.md"))
    parser.add_argument(
        "--torch-baseline",
        action="store_true",
        help="run the files against torch's own fully_shard (nothing rebound): what fails then fails on this machine anyway",
    )
    args = parser.parse_args()
    log_dir = args.report.with_suffix(".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    files = args.files or sorted(p.name for p in args.directory.glob("test_*.py"))
    lines = [f"# PyTorch FSDP2 tests against megatron_fsdp.fsdp2 (torch {torch.__version__}, gloo, CPU)", ""]
    totals = collections.Counter()
    for file_name in files:
        lines += [f"## {file_name}", ""]
        try:
            module, rebound = load_test_module(args.directory / file_name, rebind=not args.torch_baseline)
        except Exception:  # noqa: BLE001 - an unimportable file is a result, not a crash
            trace = traceback.format_exc()
            lines += [f"not importable: `{trace.strip().splitlines()[-1]}`", ""]
            totals["not importable"] += 1
            continue
        lines += [f"rebound to ours: {', '.join(rebound) or 'nothing'}", ""]
        counts = collections.Counter()
        for cls, method in test_cases(module):
            name = f"{cls.__name__}.{method}"
            if args.pattern not in name:
                continue
            world_size = min(_world_size(cls, method), args.max_world_size)
            _, gated = _body(cls, method)
            start = time.monotonic()
            status, detail, our_calls = run_case(cls, method, world_size, args.timeout, log_dir)
            seconds = time.monotonic() - start
            # Under --torch-baseline nothing is rebound, so no call of ours is counted.
            ours_never_called = our_calls == 0 and not args.torch_baseline
            reason = classify(detail, ours_never_called) if status == "failed" else ""
            if status == "passed" and ours_never_called:
                status = "passed without calling our fully_shard"
            elif status == "failed" and ours_never_called and reason != NEVER_CALLED:
                reason += " (our fully_shard not called)"
            if detail:
                with open(log_dir / f"{name}.log", "a") as log:
                    log.write(f"\n=== harness: {status}\n{detail}\n")
            counts[status] += 1
            last = detail.strip().splitlines()[-1][:200] if detail.strip() else ""
            gate = ", GPU-gated upstream" if gated else ""
            lines.append(f"- `{name}` (world {world_size}{gate}, {seconds:.0f} s): **{status}** {reason}")
            if last:
                lines.append(f"  - `{last}`")
            print(f"{name}: {status} {reason} {last}", flush=True)
        totals.update(counts)
        summary = ", ".join(f"{key} {value}" for key, value in sorted(counts.items()))
        lines += ["", f"{file_name}: {summary}", ""]
    lines += ["## Total", "", ", ".join(f"{key} {value}" for key, value in sorted(totals.items()))]
    args.report.write_text("\n".join(lines) + "\n")
    print(f"report: {args.report}", flush=True)


if __name__ == "__main__":
    main()
