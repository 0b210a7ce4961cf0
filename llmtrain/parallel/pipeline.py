"""Pipeline parallelism's distribution (the stages themselves: model/stages.py; the step through a schedule:
loop/pipeline.py): the groups, the split, the replicas' gradients and the norm, and the checkpoint files.

Layout. `parallel.pipeline_parallel: P` on W processes: D = W / P data-parallel replicas of a P-stage pipeline. The
stage is the outer dimension: rank r is stage r // D of pipeline r % D, so neighbouring stages are D ranks apart (on
2 nodes of 8 with P = 2, stage 0 is node 0 and stage 1 node 1: one boundary crosses the network, carrying hidden
states, while the data-parallel gradient all-reduce stays inside each node). With interleaved_1f1b each process holds
V = pipeline_chunks stages, virtual stage s on pipeline rank s % P (torch's loop order).

The split is parallel/stages.py's (shared with the memory estimate): the embedding, the decoder layers and the head
(with the final norm and the loss) in order, cut into P x V runs of consecutive layers, balanced by cost with the
embedding and the head each counted as one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtrain.errors import LLMTrainError


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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm_(params, max_norm: float, device, *, sharded: bool, g: PipelineGroup,
                    order: dict[int, int] | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model. Whole stages (`order`: each parameter's place in the
    whole model's parameters): the norm exactly as one process computes it, the vector norm of the stacked
    per-parameter norms (torch's own: foreach where it has it) in the model's order, gathered from the stages. A sum
    of squares reduced over the stages differs from it in the last bits, which bf16 autocast turns into 1e-6 of loss
    a step later (issue 59). Stages sharded by FSDP: the squared norms summed over the stages and the shards (every
    process holds a disjoint piece)."""
    import torch.distributed as dist

    grads = [_local(p.grad) for p in params if p.grad is not None]
    if order is not None and not sharded:
        from torch.utils._foreach_utils import _has_foreach_support

        norms = list(torch._foreach_norm(grads, 2.0)) if grads and _has_foreach_support(grads, device) else \
            [torch.linalg.vector_norm(gr, 2.0) for gr in grads]
        held = torch.stack([n.double() for n in norms]).tolist() if norms else []  # exact; one sync
        mine = [(order[id(p)], str(n.dtype), v) for p, n, v in zip([p for p in params if p.grad is not None], norms,
                                                                    held)]
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
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


# --------------------------------------------------------------------------- checkpoints and the export
# A pipeline checkpoint holds, in <step>/pipeline/, one weights file and one optimizer file per stage, written by the
# stage's first replica, every tensor under its name in the whole model (the optimizer's moments too). So a stage
# reads what it holds by name from whichever files have it, and a resume may split the layers differently (another
# pipeline degree or schedule) and still restore every weight and moment exactly.

FOLDER = "pipeline"


def _names(model) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _skips_save(model, g: PipelineGroup) -> bool:
    """A replica that is not its stage's first has nothing to do at a save: its stage's tensors are whole on the
    first one too, unless FSDP shards them (then every replica takes part in gathering them)."""
    return g.replica != 0 and not any(hasattr(p, "full_tensor") for p in model.parameters())


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole, on the CPU: a DTensor's shards gathered (a collective: every replica of the stage calls it)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().contiguous()


def write_stage(folder, model, optimizer, *, g: PipelineGroup, trainable_only: bool) -> None:
    """This process's stages' weights (the adapter's alone for LoRA) and optimizer state, whole, by parameter name;
    the first replica of each stage writes them (the others hold the same, or under FSDP their shards, gathered)."""
    from safetensors.torch import save_file

    if _skips_save(model, g):
        return
    weights = {n: _whole(p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    names, state = _names(model), optimizer.state_dict()
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    moments = {order[i]: {k: _whole(v) if torch.is_tensor(v) else v for k, v in s.items()}
               for i, s in state["state"].items()}
    if g.replica != 0:
        return
    out = folder / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / f"stage_{g.rank:03d}.safetensors"))
    torch.save({"state": moments,
                "groups": [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]},
               out / f"stage_{g.rank:03d}_optimizer.pt")


def _placed(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor read from a checkpoint as `like` holds it: under FSDP this process's shard (every process read
    the same file, so each takes its own piece without communication)."""
    if not hasattr(like, "device_mesh") or t.shape != like.shape:
        return t
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.to(like.device_mesh.device_type), like.device_mesh, like.placements,
                             src_data_rank=None)


def read_stages(folder, model, optimizer, *, trainable_only: bool) -> None:
    """Restore this process's weights and optimizer state by name from every stage file of a pipeline checkpoint;
    a parameter found in none of them stops the resume."""
    from safetensors import safe_open

    src = folder / FOLDER
    wanted = {n: p for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    found, moments, groups = {}, {}, []
    for f in sorted(src.glob("stage_*.safetensors")):
        with safe_open(str(f), "pt") as r:
            found.update({k: r.get_tensor(k) for k in r.keys() if k in wanted})
        saved = torch.load(f.with_name(f.stem + "_optimizer.pt"), weights_only=True, mmap=True)
        moments.update({k: v for k, v in saved["state"].items() if k in wanted})
        groups = groups or saved["groups"]
    if missing := sorted(set(wanted) - set(found)):
        raise LLMTrainError(f"checkpoint {folder} holds no weights for {len(missing)} parameters of this process's "
                            f"pipeline stages (e.g. {missing[0]}): it was written by another model or layout. "
                            f"Resume with the recipe that wrote it ({folder}/recipe.yaml)")
    with torch.no_grad():
        for n, t in found.items():
            wanted[n].copy_(_placed(t, wanted[n]))
    names, state = _names(model), optimizer.state_dict()
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    params = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    state["state"] = {i: {k: _placed(v, params[n]) if torch.is_tensor(v) else v for k, v in moments[n].items()}
                      for i, n in enumerate(order) if n in moments}
    for group in state["param_groups"]:  # the saved group of the same weight decay (decayed or not)
        saved = next(s for s in groups if s["weight_decay"] == group["weight_decay"])
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.load_state_dict(state)


def gather_state_dict(model, *, g: PipelineGroup, trainable_only: bool) -> dict:
    """The whole model's state dict (the adapter's alone for LoRA) on the main process, from every stage's first
    replica ({} elsewhere): for final/, which holds the whole model as every other run's does."""
    import torch.distributed as dist

    trained = {k for k, p in model.named_parameters() if p.requires_grad}
    mine = ({} if _skips_save(model, g) else
            {n: _whole(t) for n, t in model.state_dict().items() if not trainable_only or n in trained})
    mine = mine if g.replica == 0 else {}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else {}
