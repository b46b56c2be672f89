"""``python -m megatron_fsdp.plan_memory``: see command.py."""

from megatron_fsdp.plan_memory.command import main

main()
