"""Pipeline parallelism's checkpoint files and the export: each stage's weights and optimizer state, whole, under
their names in the whole model, so that a resume may split the layers differently."""

from __future__ import annotations

import torch

from llmtrain.errors import LLMTrainError
from llmtrain.parallel.pipeline.group import PipelineGroup

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


def _whole_state(v):
    """A parameter's optimizer state with every tensor whole, nested sections too (bitsandbytes keeps its 8-bit
    moments in one)."""
    if isinstance(v, dict):
        return {k: _whole_state(x) for k, x in v.items()}
    return _whole(v) if torch.is_tensor(v) else v


def write_stage(folder, model, optimizer, *, g: PipelineGroup, trainable_only: bool) -> None:
    """This process's stages' weights (the adapter's alone for LoRA) and optimizer state, whole, by parameter name;
    the first replica of each stage writes them (the others hold the same, or under FSDP their shards, gathered)."""
    from safetensors.torch import save_file

    if _skips_save(model, g):
        return
    weights = {n: _whole(p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    names, state = _names(model), optimizer.state_dict()
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    moments = {order[i]: _whole_state(s) for i, s in state["state"].items()}
    params = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    if g.replica != 0:
        return
    out = folder / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / f"stage_{g.rank:03d}.safetensors"))
    torch.save({"state": moments, "pieces": _pieces(moments, params),
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


def _pieces(moments: dict, params: dict) -> dict:
    """The number of shards of each parameter whose state holds 8-bit blocks (adamw_8bit.shards_of: its absmax is laid
    out by them; bitsandbytes is there wherever such a state is)."""
    if not any(_blockwise(s) for s in moments.values()):
        return {}
    from llmtrain.model.adamw_8bit import shards_of

    return {n: shards_of(params[n]) for n, s in moments.items() if _blockwise(s)}


def _whole_blocks(shape, *pieces: int) -> bool:
    """adamw_8bit.whole_blocks for each number of shards (bitsandbytes is there wherever 8-bit state is)."""
    from llmtrain.model.adamw_8bit import whole_blocks

    return all(whole_blocks(shape, k) for k in pieces)


def _blockwise(state: dict) -> bool:
    """Whether a parameter's saved state holds bitsandbytes' blockwise 8-bit moments (an absmax a block)."""
    return any(k.startswith("absmax") or isinstance(v, dict) and _blockwise(v) for k, v in state.items())


def _placed_state(v, like: torch.Tensor, key: str = ""):
    """A parameter's saved optimizer state as `like` holds it (_placed), nested sections too; under FSDP the 8-bit
    AdamW's absmax as its own layout splits it (model/adamw_8bit.absmax_layout: each shard's blocks)."""
    if isinstance(v, dict):
        return {k: _placed_state(x, like, k) for k, x in v.items()}
    if not torch.is_tensor(v):
        return v
    if key.startswith("absmax") and hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        from llmtrain.model.adamw_8bit import absmax_layout

        _, mesh, placements = absmax_layout(like)
        return distribute_tensor(v.to(mesh.device_type), mesh, placements, src_data_rank=None)
    return _placed(v, like)


def read_stages(folder, model, optimizer, *, trainable_only: bool) -> None:
    """Restore this process's weights and optimizer state by name from every stage file of a pipeline checkpoint;
    a parameter found in none of them stops the resume."""
    from safetensors import safe_open

    src = folder / FOLDER
    wanted = {n: p for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    found, moments, groups, pieces = {}, {}, [], {}
    for f in sorted(src.glob("stage_*.safetensors")):
        with safe_open(str(f), "pt") as r:
            found.update({k: r.get_tensor(k) for k in r.keys() if k in wanted})
        saved = torch.load(f.with_name(f.stem + "_optimizer.pt"), weights_only=True, mmap=True)
        moments.update({k: v for k, v in saved["state"].items() if k in wanted})
        pieces.update(saved.get("pieces", {}))
        groups += saved["groups"]  # every stage's: a group held by one stage only (LoRA+'s embedding) is found
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
    for n, now in _pieces({n: moments[n] for n in params if n in moments}, params).items():
        if (was := pieces.get(n, 1)) != now and not _whole_blocks(params[n].shape, was, now):
            raise LLMTrainError(
                f"checkpoint {folder} holds train.optimizer=adamw_8bit's moments of {n} quantised in blocks of each of "
                f"{was} shard(s) of its stage, and this launch splits it into {now}: bitsandbytes' blocks of 256 "
                "elements start at each shard's first element, so 8-bit moments resume on the shards that wrote them, "
                f"or where both split its {params[n].shape[0]:,} rows evenly into whole blocks (not so here). Resume "
                "it with the launch and parallel.pipeline_parallel that wrote it, or start a new run in another "
                "output_dir.")
    state["state"] = {i: _placed_state(moments[n], params[n]) for i, n in enumerate(order) if n in moments}
    for group in state["param_groups"]:  # the saved group of the same name (LoRA+'s) and weight decay; none saved
        # (a group of parameters no stage trained: nothing of it to restore) leaves this one's settings as they are
        saved = next((s for s in groups if s.get("name") == group.get("name")
                      and s["weight_decay"] == group["weight_decay"]), {})
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
    return {k: v for part in parts for k, v in part.items()} if parts else {}  # a tied head: export.save_final

