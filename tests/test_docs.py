"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

Each block runs as a reader runs it: saved as a script in a temporary working directory and
launched with ``python -m torch.distributed.run --standalone --nproc-per-node N`` (torchrun; on
CPU, so gloo), from this checkout (``PYTHONPATH`` at its root, for ``examples/``). Nothing is set
up for it: a block that needs a process group creates it, or lets ``fully_shard`` create it
from torchrun's environment. An HTML comment on the line before a block changes how it runs:

- ``<!-- doc-test: ranks=N -->``: N processes (default 1).
- ``<!-- doc-test: skip (why) -->``: do not run it; the reason is required. Kept to a minimum.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)
MAX_SKIPPED = 2


@dataclass(frozen=True)
class DocBlock:
    path: str
    line: int
    code: str
    ranks: int
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_marker(marker: str | None, where: str) -> tuple[int, str | None]:
    if marker is None:
        return 1, None
    if match := re.fullmatch(r"ranks=(\d+)", marker):
        return int(match.group(1)), None
    if match := re.fullmatch(r"skip \((.+)\)", marker):
        return 1, match.group(1)
    raise ValueError(f"{where}: unknown doc-test marker {marker!r}: use 'ranks=N' or 'skip (reason)'")


def collect_blocks() -> list[DocBlock]:
    blocks = []
    for path in DOCS:
        with open(os.path.join(ROOT, path)) as handle:
            text = handle.read()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            ranks, reason = _parse_marker(match.group("marker"), f"{path}:{line}")
            blocks.append(DocBlock(path, line, match.group("code"), ranks, reason))
    return blocks


BLOCKS = collect_blocks()


# A block that runs longer is stopped and fails (the slowest take ~15 s on a 2-core machine).
BLOCK_TIMEOUT_S = 180


def _run_as_script(block: DocBlock, workdir: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N`` of the block saved as a script in ``workdir``;
    stopped with every process it started after ``BLOCK_TIMEOUT_S``."""
    script = os.path.join(workdir, "doc_block.py")
    with open(script, "w") as handle:
        handle.write(block.code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",  # torchrun's own default for several processes, set here to keep its warning out
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.ranks}", script]
    launcher = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = launcher.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)  # torchrun and the ranks it started: their own session
        output, _ = launcher.communicate()
        output += f"\n[stopped after {BLOCK_TIMEOUT_S} s]"
    return subprocess.CompletedProcess(command, launcher.returncode, output)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip_reason is None], ids=lambda b: b.name)
def test_doc_code_block_runs_under_torchrun(block: DocBlock, tmp_path) -> None:
    run = _run_as_script(block, str(tmp_path))
    assert run.returncode == 0, f"{block.name} under torchrun exited {run.returncode}:\n{run.stdout[-8000:]}"


def test_few_doc_blocks_are_skipped_and_each_says_why() -> None:
    skipped = [f"{b.name} ({b.skip_reason})" for b in BLOCKS if b.skip_reason is not None]
    assert len(skipped) <= MAX_SKIPPED, f"too many blocks skipped: {skipped}"
    assert len(BLOCKS) - len(skipped) >= 10, "the docs should show running code"


def test_a_block_that_makes_the_process_group_destroys_it() -> None:
    # Left to the interpreter's teardown, gloo's threads can abort a rank after the block succeeded
    # (fully_shard destroys the group it makes itself; tests/test_default_group.py).
    makes_group = ("init_process_group(", "init_device_mesh(")
    undestroyed = [b.name for b in BLOCKS if b.ranks > 1 and any(call in b.code for call in makes_group)
                   and not b.code.rstrip().splitlines()[-1].lstrip().split("#")[0].rstrip().endswith("destroy_process_group()")]
    assert not undestroyed, f"end these blocks with dist.destroy_process_group(): {undestroyed}"


# A repository path in backticks, as the docs name files: `megatron_fsdp/engine/buckets/buffer.py`.
REPO_PATH = re.compile(r"`((?:megatron_fsdp|tests|examples|benchmarks|scripts|csrc|docs)/[\w./-]+)`")


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for path in DOCS:
        with open(os.path.join(ROOT, path)) as handle:
            for number, line in enumerate(handle, start=1):
                missing += [f"{path}:{number}: {name}" for name in REPO_PATH.findall(line)
                            if not os.path.exists(os.path.join(ROOT, name.rstrip("/")))]
    assert not missing, "paths named in the docs that are not in the tree:\n" + "\n".join(missing)


ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
# A row of the map: | `megatron_fsdp/<folder>/` or `megatron_fsdp/<module>.py`, ... | what, naming modules |
MAP_ROW = re.compile(r"^\| (?P<where>`megatron_fsdp/[^|]+) \| (?P<what>.+) \|$")
MODULE_NAME = re.compile(r"`([\w./]+\.py)`")


def map_entries() -> tuple[set[str], set[str]]:
    """The folders and modules docs/architecture.md's map names, as repository paths: a row's
    first cell names a folder (or modules of one folder), its modules are named relative to it."""
    with open(ARCHITECTURE) as handle:
        section = handle.read().split("## The map", 1)[1].split("\n## ", 1)[0]
    folders, modules = set(), set()
    for row in filter(None, map(MAP_ROW.match, section.splitlines())):
        where = re.findall(r"`([^`]+)`", row["where"])
        folder = where[0] if where[0].endswith("/") else os.path.dirname(where[0]) + "/"
        folders.add(folder)
        for name in [w for w in where if w.endswith(".py")] + MODULE_NAME.findall(row["what"]):
            modules.add(name if name.startswith("megatron_fsdp/") else folder + name)
    return folders, modules


def test_the_architecture_map_names_every_module_and_no_other() -> None:
    folders, modules = map_entries()
    package = os.path.join(ROOT, "megatron_fsdp")
    present = {
        os.path.relpath(os.path.join(where, name), ROOT)
        for where, _, names in os.walk(package)
        for name in names
        if name.endswith(".py")
    }
    # A package's __init__.py is named by its folder's row.
    unnamed = sorted(
        path for path in present
        if path not in modules and not (path.endswith("/__init__.py") and os.path.dirname(path) + "/" in folders)
    )
    assert not unnamed, "modules docs/architecture.md's map does not name (add each to its folder's row):\n" + "\n".join(unnamed)
    missing = sorted(modules - present)
    assert not missing, "modules the map names that are not in the tree:\n" + "\n".join(missing)
