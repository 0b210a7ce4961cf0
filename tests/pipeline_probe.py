"""Run by tests/test_memory_pipeline.py under `torch.distributed.run` (gloo, CPU): torch's own pipeline schedules
on stages of one linear layer each, counting per (virtual) stage the micro-batches whose forward has run and whose
backward has not begun (a hook on each stage's output fires when its gradient arrives). Each rank writes, as JSON, the
counts per chunk at the moment their sum was largest.

    python -m torch.distributed.run --nproc_per_node P tests/pipeline_probe.py SCHEDULE MICRO_BATCHES CHUNKS OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def main(schedule: str, micro_batches: int, chunks: int, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    held, most = [0] * chunks, {"total": -1}

    def count(k: int):
        def forward_hook(module, args, output):
            if not output.requires_grad:  # torch 2.11's stage infers the shapes with a forward of its own first
                return
            held[k] += 1
            if sum(held) > most["total"]:
                most.update(total=sum(held), held=list(held))

            def backward_begins(grad):
                held[k] -= 1
            output.register_hook(backward_begins)
        return forward_hook

    stages = []
    for k in range(chunks):
        layer = torch.nn.Linear(8, 8)
        layer.register_forward_hook(count(k))
        stages.append(PipelineStage(layer, rank + k * ranks, ranks * chunks, torch.device("cpu")))
    kind = SCHEDULES[schedule]
    loss = torch.nn.functional.mse_loss
    run = kind(stages, micro_batches, loss_fn=loss) if chunks > 1 or schedule == "interleaved_1f1b" else \
        kind(stages[0], micro_batches, loss_fn=loss)
    x, target = torch.randn(micro_batches * 2, 8), torch.randn(micro_batches * 2, 8)
    for _ in range(2):  # the first step also runs torch's shape inference (a forward and backward of its own)
        held[:] = [0] * chunks
        most.update(total=-1)
        if rank == 0:
            run.step(x)
        elif rank == ranks - 1:
            run.step(target=target)
        else:
            run.step()
    (out / f"rank{rank}.json").write_text(json.dumps(most["held"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    from llmtrain.cli import exit_now

    exit_now(0)  # as a launched run leaves: no interpreter teardown for a gloo thread to abort (pytorch#179291)
