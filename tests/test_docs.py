"""Every ```python block of README.md and docs/*.md runs as the page says to run it, so the docs
cannot drift from the code.

A runnable block is followed by its launch line, shown to the reader in a ```bash block of one
line: ``torchrun --standalone --nproc-per-node N NAME.py`` (N processes; on CPU, so gloo) or
``python NAME.py``. The test saves the block as NAME.py in a temporary directory and runs exactly
that line there (``torchrun`` and ``python`` being this interpreter's), with the package under
test importable as an installed one is, and nothing else: no checkout on the path. A block that
imports ``examples.`` (the repository's example models) is run from the repository root, and
the text before its launch line must say so; the test gives its directory the root's
``examples/``. A ```text block right after the launch line shows what the block prints, exactly.
Nothing else is set up: a block that needs a process group creates it, or lets
``fully_shard`` create it from torchrun's environment.

``<!-- doc-test: skip (why) -->`` on the line before a block: do not run it; the reason is
required. Kept to a minimum.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
BLOCK = re.compile(
    r"(?:<!-- doc-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```\n"
    r"(?:(?P<intro>(?:(?!```)[^\n]*\n)*?)```bash\n(?P<launch>[^\n]*)\n```\n(?:\n```text\n(?P<output>[^`]*)```)?)?",
    re.DOTALL,
)
# What a launch line may be: torchrun on one machine, or python, of the block saved as NAME.py.
LAUNCH = re.compile(r"(?:torchrun --standalone --nproc-per-node (?P<ranks>\d+)|python) (?P<script>\w+\.py)")
MAX_SKIPPED = 2


@dataclass(frozen=True)
class DocBlock:
    path: str
    line: int
    code: str
    launch: str | None
    intro: str
    output: str | None  # what the page shows it prints, in a ```text block right after the launch line
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def ranks(self) -> int:
        match = LAUNCH.fullmatch(self.launch or "")
        return int(match["ranks"] or 1) if match else 1

    @property
    def from_root(self) -> bool:
        return bool(re.search(r"^(?:from|import) examples\b", self.code, re.MULTILINE))


def _skip_reason(marker: str | None, where: str) -> str | None:
    if marker is None:
        return None
    if match := re.fullmatch(r"skip \((.+)\)", marker):
        return match.group(1)
    raise ValueError(f"{where}: unknown doc-test marker {marker!r}: use 'skip (reason)', and show the launch line")


def collect_blocks() -> list[DocBlock]:
    blocks = []
    for path in DOCS:
        with open(os.path.join(ROOT, path)) as handle:
            text = handle.read()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            reason = _skip_reason(match.group("marker"), f"{path}:{line}")
            blocks.append(DocBlock(path, line, match.group("code"), match.group("launch"), match.group("intro") or "",
                                   match.group("output"), reason))
    return blocks


BLOCKS = collect_blocks()
RUNNABLE = [b for b in BLOCKS if b.skip_reason is None]


def test_every_runnable_block_shows_how_to_launch_it() -> None:
    """The line a reader types follows each block, in the form the test runs; a block that needs
    the repository root says so before it."""
    problems = [f"{b.name}: follow it with ```bash\\ntorchrun --standalone --nproc-per-node N NAME.py\\n``` (or python NAME.py)"
                for b in RUNNABLE if not LAUNCH.fullmatch(b.launch or "")]
    problems += [f"{b.name}: it imports examples/: say before its launch line that it runs from the repository root"
                 for b in RUNNABLE if b.from_root and "repository root" not in b.intro]
    names = [LAUNCH.fullmatch(b.launch)["script"] for b in RUNNABLE if LAUNCH.fullmatch(b.launch or "")]
    problems += [f"script name {name} is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    assert not problems, "\n".join(problems)


# A block that runs longer is stopped and fails (the slowest take ~15 s on a 2-core machine).
BLOCK_TIMEOUT_S = 180


def _environment(workdir: str) -> dict[str, str]:
    """The block's environment: the package under test importable from a directory of its own
    (a link to it), as an installed package is; this checkout itself is not on the path."""
    site = os.path.join(workdir, "site")
    os.makedirs(site)
    os.symlink(os.path.join(ROOT, "megatron_fsdp"), os.path.join(site, "megatron_fsdp"))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != ROOT]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([site, *inherited]),
        "OMP_NUM_THREADS": "1",  # torchrun's own default for several processes, set here to keep its warning out
    }


def _run_as_shown(block: DocBlock, workdir: str) -> subprocess.CompletedProcess:
    """The block's launch line, run in ``workdir`` holding the block as the script it names;
    stopped with every process it started after ``BLOCK_TIMEOUT_S``."""
    command = shlex.split(block.launch)
    with open(os.path.join(workdir, command[-1]), "w") as handle:
        handle.write(block.code)
    if block.from_root:  # what the repository root holds for it
        os.symlink(os.path.join(ROOT, "examples"), os.path.join(workdir, "examples"))
    program = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "python": [sys.executable]}[command[0]]
    launcher = subprocess.Popen(
        program + command[1:], cwd=workdir, env=_environment(workdir), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        output, errors = launcher.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)  # torchrun and the ranks it started: their own session
        output, errors = launcher.communicate()
        errors += f"\n[stopped after {BLOCK_TIMEOUT_S} s]"
    return subprocess.CompletedProcess(command, launcher.returncode, output, errors)


@pytest.mark.parametrize("block", [b for b in RUNNABLE if LAUNCH.fullmatch(b.launch or "")], ids=lambda b: b.name)
def test_doc_code_block_runs_as_shown(block: DocBlock, tmp_path) -> None:
    run = _run_as_shown(block, str(tmp_path))
    assert run.returncode == 0, f"{block.name}: `{block.launch}` exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    # A reader sees what it did: each example prints its losses, what it saved and where.
    assert run.stdout.strip(), f"{block.name}: `{block.launch}` printed nothing:\n{run.stderr[-3000:]}"
    if block.output is not None:  # the output the page shows is the output it gives
        assert run.stdout.strip() == block.output.strip(), f"{block.name} printed, where the page shows another output:\n{run.stdout}"


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


# A name of the package in backticks, as the docs name what to import: `megatron_fsdp.OptimizerSpec`.
PACKAGE_NAME = re.compile(r"`(megatron_fsdp(?:\.\w+)+)(?![\w./])")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_every_package_name_the_docs_give_can_be_imported() -> None:
    named = {(name, path) for path in DOCS for name in PACKAGE_NAME.findall(open(os.path.join(ROOT, path)).read())
             if not name.endswith(".py")}
    missing = sorted(f"{path}: {name}" for name, path in named if not _resolves(name))
    assert not missing, "names the docs give that megatron_fsdp does not have:\n" + "\n".join(missing)


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
