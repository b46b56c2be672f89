"""Run under torchrun at world 2 by tests/test_whole_matrix_optimizers.py: over FSDP2's door, a
declared whole-tensor optimizer whose step raises on the rank that owns qkv only, uncaught there
(the program ends on it). The other rank's step passed; it prints what its step raised."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp.fsdp2 import fully_shard
from models import make_batch, make_model
from test_whole_matrix_optimizers import ROWS, RefusesQkv


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model(seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    optimizer = RefusesQkv([params["blocks.0.qkv.weight"], params["blocks.0.up.weight"]], lr=0.1)
    model(*make_batch(0, ROWS)).backward()
    try:
        optimizer.step()
    except RuntimeError as error:  # the rank whose own step passed
        print(f"rank {dist.get_rank()}: {type(error).__name__}: {error}", flush=True)
        return
    print(f"rank {dist.get_rank()}: stepped", flush=True)


if __name__ == "__main__":
    main()
