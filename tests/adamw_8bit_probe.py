"""Run by tests/test_optimizer_8bit.py under torchrun: parameters of a few shapes sharded by torch's fully_shard over
the processes (gloo), updated by llmtrain's 8-bit AdamW from the same gradients as one process's bnb.optim.AdamW8bit
(drawn from a fixed seed, whole, and cut to each shard), then gathered and written to OUT by rank 0.

python -m torch.distributed.run --nproc_per_node 2 tests/adamw_8bit_probe.py OUT"""

import sys

import torch
import torch.distributed as dist

SHAPES = {
    "aligned": (256, 128),  # 128 rows of 128 columns a process: 64 whole blocks of 256
    "misaligned": (101, 128),  # 51 / 50 rows: rank 1's blocks start half a block off one process's
    "small": (40, 64),  # 2,560 elements, under bitsandbytes' 4,096: 32-bit moments
    "one_row": (1, 8192),  # rank 1 holds no row of it
}
STEPS = 5


def parameters() -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02) for name, shape in SHAPES.items()}


def gradients(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=gen) * 10 ** (step % 3 - 2) for name, shape in SHAPES.items()}


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from llmtrain.model.adamw_8bit import AdamW8bit

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    module = torch.nn.Module()
    for name, p in parameters().items():
        module.register_parameter(name, p)
    fully_shard(module, mesh=mesh)
    optimizer = AdamW8bit(module.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(STEPS):
        for name, g in gradients(step).items():
            p = getattr(module, name)
            p.grad = distribute_tensor(g, mesh, p.placements)
        optimizer.step()
    whole = {name: getattr(module, name).full_tensor() for name in SHAPES}
    if dist.get_rank() == 0:
        torch.save(whole, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
