"""Runs a Megatron-LM training script, unchanged, on megatron_fsdp instead of megatron-core's
bundled copy of megatron-fsdp:

    torchrun --nproc-per-node 8 -m megatron_fsdp.integrations.launch pretrain_gpt.py --use-megatron-fsdp ...

It calls :func:`megatron_fsdp.integrations.megatron_core.install` and then runs the script as
``__main__`` with the remaining arguments, as ``python pretrain_gpt.py ...`` would (the script's
folder first on ``sys.path``, so its neighbours such as ``gpt_builders.py`` import).
"""

from __future__ import annotations

import os
import runpy
import sys

from megatron_fsdp.integrations import megatron_core


def main(argv: list[str]) -> None:
    """``argv``: the script's path, then its arguments."""
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit(
            "usage: python -m megatron_fsdp.integrations.launch SCRIPT.py [ARGS...] "
            "(e.g. torchrun --nproc-per-node 8 -m megatron_fsdp.integrations.launch pretrain_gpt.py --use-megatron-fsdp ...)"
        )
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_fsdp.integrations.launch: no script at {script}")
    megatron_core.install()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
