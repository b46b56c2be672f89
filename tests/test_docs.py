"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

Each block runs on its own, in fresh gloo processes whose process group is already initialised
(as under torchrun), in a temporary working directory. An HTML comment on the line before a
block changes that:

- ``<!-- doc-test: ranks=N -->``: run on N ranks (default 1).
- ``<!-- doc-test: skip (why) -->``: do not run it; the reason is required. Kept to a minimum.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

from _dist import run_distributed

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


def _run_block(rank: int, world: int, code: str, name: str, workdir: str) -> None:
    os.chdir(workdir)
    exec(compile(code, name, "exec"), {"__name__": "__doc_block__"})


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip_reason is None], ids=lambda b: b.name)
def test_doc_code_block_runs(block: DocBlock, tmp_path) -> None:
    run_distributed(_run_block, block.ranks, block.code, block.name, str(tmp_path), timeout=180)


def test_few_doc_blocks_are_skipped_and_each_says_why() -> None:
    skipped = [f"{b.name} ({b.skip_reason})" for b in BLOCKS if b.skip_reason is not None]
    assert len(skipped) <= MAX_SKIPPED, f"too many blocks skipped: {skipped}"
    assert len(BLOCKS) - len(skipped) >= 10, "the docs should show running code"


# A repository path in backticks, as the docs name files: `megatron_fsdp/engine/buffer.py`.
REPO_PATH = re.compile(r"`((?:megatron_fsdp|tests|examples|benchmarks|scripts|csrc|docs)/[\w./-]+)`")


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for path in DOCS:
        with open(os.path.join(ROOT, path)) as handle:
            for number, line in enumerate(handle, start=1):
                missing += [f"{path}:{number}: {name}" for name in REPO_PATH.findall(line)
                            if not os.path.exists(os.path.join(ROOT, name.rstrip("/")))]
    assert not missing, "paths named in the docs that are not in the tree:\n" + "\n".join(missing)
