"""Pipeline parallelism's processes: the groups, the replicas' gradients and the norm (the stages: stage.py, their
split: split.py, the step through a schedule: schedule.py, the checkpoint files: checkpoint.py).

Layout. `parallel.pipeline_parallel: P` on W processes: D = W / P data-parallel replicas of a P-stage pipeline. The
stage is the outer dimension: rank r is stage r // D of pipeline r % D, so neighbouring stages are D ranks apart (on
2 nodes of 8 with P = 2, stage 0 is node 0 and stage 1 node 1: one boundary crosses the network, carrying hidden
states, while the data-parallel gradient all-reduce stays inside each node). With interleaved_1f1b each process holds
V = pipeline_chunks stages, virtual stage s on pipeline rank s % P (torch's loop order).

The split is split.py's (shared with the memory estimate): the embedding, the decoder layers and the head
(with the final norm and the loss) in order, cut into P x V runs of consecutive layers, balanced by cost with the
embedding and the head each counted as one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtrain.model.split import local


@dataclass(frozen=True)
class PipelineGroup:
    size: int = 1  # pipeline stages P (processes of one pipeline)
    rank: int = 0  # this process's place in its pipeline
    replicas: int = 1  # data-parallel pipelines D
    replica: int = 0  # which pipeline this process is in: its data rank
    group: object = None  # the process group of this process's pipeline (its stages)
    data_group: object = None  # the process group of the replicas of this process's stage
    mesh: object = None  # the (pp, dp) DeviceMesh: FSDP shards a stage over its dp dimension


def make_group(size: int) -> PipelineGroup:
    """This process's pipeline and its stage's replicas, formed once the process group exists as a (pp, dp) device
    mesh whose dp dimension FSDP shards over when the launch asks for it; size 1: none. Kept with the run's other
    groups (parallel/groups.py), never in a module global."""
    if size == 1:
        return PipelineGroup()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()  # size divides world: layout.py checked it
    replicas = world // size
    # row-major: mesh[s][d] is rank s * replicas + d, stage s of pipeline d
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (size, replicas),
                            mesh_dim_names=("pp", "dp"))
    return PipelineGroup(size=size, rank=rank // replicas, replicas=replicas, replica=rank % replicas,
                         group=mesh["pp"].get_group(), data_group=mesh["dp"].get_group(), mesh=mesh)


def sum_replicas(params, g: PipelineGroup) -> None:
    """Data parallelism across pipelines: each stage's gradients summed over its replicas (one all-reduce a
    parameter; a parameter without a gradient on this replica, e.g. a placeholder row's, adds zeros). Not under
    FSDP, whose reduce-scatter does it."""
    if g.replicas == 1:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=g.data_group)


def ends_group(g: PipelineGroup):
    """The process group of this process's pipeline's first and last stages (a tied embedding's two copies), None
    on the stages between them. Every process calls it (each such group is made by all); with 2 stages, the
    pipeline's own group."""
    if g.size == 2:
        return g.group
    import torch.distributed as dist

    mine = None
    for d in range(g.replicas):  # rank s * replicas + d is stage s of pipeline d (make_group)
        ranks = [d, (g.size - 1) * g.replicas + d]
        made = dist.new_group(ranks)
        mine = made if dist.get_rank() in ranks else mine
    return mine


def sum_tied(params, group) -> None:
    """A weight the first stage reads as the embedding and the last as the LM head (tie_word_embeddings): each
    copy's gradient becomes their sum, the gradient one process computes for the one weight, so both copies take
    the same step. Under FSDP each process sums its shard with the same shard of the other end."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local(p.grad), group=group)




def clip_grad_norm_(params, max_norm: float, device, *, sharded: bool, g: PipelineGroup,
                    order: dict[int, int] | None = None, uncounted=()) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model. Whole stages (`order`: each parameter's place in the
    whole model's parameters): the norm exactly as one process computes it, the vector norm of the stacked
    per-parameter norms (torch's own: foreach where it has it) in the model's order, gathered from the stages. A sum
    of squares reduced over the stages differs from it in the last bits, which bf16 autocast turns into 1e-6 of loss
    a step later (issue 59). Stages sharded by FSDP: the squared norms summed over the stages and the shards (every
    process holds a disjoint piece). `uncounted`: parameters scaled but left out of the norm (the last stage's copy
    of a tied embedding, which the first stage counts)."""
    import torch.distributed as dist

    scaled = [local(p.grad) for p in params if p.grad is not None]
    skip = {id(p) for p in uncounted}
    params = [p for p in params if p.grad is not None and id(p) not in skip]
    grads = [local(p.grad) for p in params]
    if order is not None and not sharded:
        from torch.utils._foreach_utils import _has_foreach_support

        norms = list(torch._foreach_norm(grads, 2.0)) if grads and _has_foreach_support(grads, device) else \
            [torch.linalg.vector_norm(gr, 2.0) for gr in grads]
        held = torch.stack([n.double() for n in norms]).tolist() if norms else []  # exact; one sync
        mine = [(order[id(p)], str(n.dtype), v) for p, n, v in zip(params, norms, held)]
        stages: list = [None] * g.size
        dist.all_gather_object(stages, mine, group=g.group)
        ranked = sorted(x for part in stages for x in part)
        groups = list(dict.fromkeys(dtype for _, dtype, _ in ranked))  # torch groups the norms by dtype, in order
        values = [torch.tensor(v, dtype=getattr(torch, d.removeprefix("torch.")), device=device)
                  for dtype in groups for _, d, v in ranked if d == dtype]
        norm = torch.linalg.vector_norm(torch.stack(values), 2.0) if values else torch.zeros((), device=device)
    else:
        squares = (torch.stack([torch.linalg.vector_norm(gr, dtype=torch.float32) ** 2 for gr in grads]).sum()
                   if grads else torch.zeros((), device=device))
        dist.all_reduce(squares, group=None if sharded else g.group)
        norm = squares.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if scaled:
        torch._foreach_mul_(scaled, coef.to(scaled[0].device))
    return norm
