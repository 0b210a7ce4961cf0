"""Pipeline parallelism on PyTorch's own engine (torch.distributed.pipelining): the groups, the stages split by hand
from the Llama layout, and the step that runs a window's micro-batches through a schedule.

Layout. `parallel.pipeline_parallel: P` on W processes: D = W / P data-parallel replicas of a P-stage pipeline. The
stage is the outer dimension: rank r is stage r // D of pipeline r % D, so neighbouring stages are D ranks apart (on
2 nodes of 8 with P = 2, stage 0 is node 0 and stage 1 node 1: one boundary crosses the network, carrying hidden
states, while the data-parallel gradient all-reduce stays inside each node). With interleaved_1f1b each process holds
V = pipeline_chunks stages, virtual stage s on pipeline rank s % P (torch's loop order).

The split (`stage_layers`): the embedding, the decoder layers and the head (with the final norm and the loss) in
order, cut into P x V runs of consecutive layers, balanced by layer count with the embedding and the head each counted
as one layer. Each process keeps its stages' modules and drops the rest (an `_Elsewhere` placeholder keeps every kept
parameter's name: `model.layers.5.mlp...` is the same key on any pipeline degree, which checkpoints and the export
rely on). Tied embeddings are refused: the first and the last stage would each hold a copy of one weight.

Fixed shapes. A stage receives its input into buffers whose shape it learns on the first step, so every micro-batch
is one packed row of exactly train.micro_batch_tokens slots: the examples back to back, then the padding as one more
segment of its own (positions from 0, nothing trained). The examples' boundaries go to every stage as a kwarg of one
fixed length too (`cu_seq_lens` padded with its last value, trimmed in each stage on the CPU): no shape ever changes
between steps, so no buffer is stale or mis-sized.

The loss. The last stage's loss function is the run's chunked cross-entropy (model/loss.py) on the row's trained
positions, times 1 / (the window's trained tokens on every pipeline), with the schedule's `scale_grads=False`: the
sum over micro-batches and replicas of what each backpropagates is the gradient one process computes on the whole
window. The replicas' gradients are then summed over the data-parallel group (one all-reduce a parameter, after the
schedule), and the norm for clipping is the square root of the squared norms summed over the stages.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from llmtrain.data.formats import IGNORE
from llmtrain.errors import LLMTrainError


@dataclass(frozen=True)
class PipelineGroup:
    size: int = 1  # pipeline stages P (processes of one pipeline)
    rank: int = 0  # this process's place in its pipeline
    replicas: int = 1  # data-parallel pipelines D
    replica: int = 0  # which pipeline this process is in: its data rank
    group: object = None  # the process group of this process's pipeline (its stages)
    data_group: object = None  # the process group of the replicas of this process's stage


_GROUP = PipelineGroup()


def pipeline_group() -> PipelineGroup:
    return _GROUP


def pipeline_parallel_size() -> int:
    return _GROUP.size


def setup(size: int) -> None:
    """Form the pipeline and replica groups once the process group exists (size 1: none, any earlier forgotten)."""
    global _GROUP
    if size == 1:
        _GROUP = PipelineGroup()
        return
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise LLMTrainError(f"parallel.pipeline_parallel={size} splits the model into {size} stages, each on its "
                            f"own processes, but the launch has {world} processes: launch a multiple of {size} "
                            f"(--num_processes), or set parallel.pipeline_parallel to a divisor of {world}")
    replicas = world // size
    mine = mine_data = None
    for d in range(replicas):  # every process creates every group, in the same order
        g = dist.new_group([d + k * replicas for k in range(size)])
        if rank % replicas == d:
            mine = g
    for s in range(size):
        g = dist.new_group([s * replicas + j for j in range(replicas)])
        if rank // replicas == s:
            mine_data = g
    _GROUP = PipelineGroup(size=size, rank=rank // replicas, replicas=replicas, replica=rank % replicas, group=mine,
                           data_group=mine_data)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder layers of each of `stages` consecutive stages: the embedding, the layers and the head (counted as
    one layer each) cut as evenly as possible, every stage keeping at least one layer."""
    if num_layers < stages:
        raise LLMTrainError(f"the model has {num_layers} decoder layers, fewer than the {stages} pipeline stages: "
                            "lower parallel.pipeline_parallel (or pipeline_chunks)")
    units = num_layers + 2  # embedding, layers, head
    cuts = [round(k * units / stages) for k in range(stages + 1)]
    # unit u is layer u - 1; clamp so that the embedding and the head never leave a stage without a layer
    bounds = [0] + [min(max(c - 1, k), num_layers - (stages - k)) for k, c in enumerate(cuts[1:-1], 1)] + [num_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class _Elsewhere(nn.Module):
    """A module another pipeline stage holds: no parameters here, and never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class Stage(nn.Module):
    """One pipeline stage of a Llama-layout causal LM: the embedding (first stage), a run of decoder layers, the
    final norm and the head (last stage). Every stage computes the rotary embedding from the positions it is
    given, and the varlen attention takes the row's example boundaries from `cu_seq_lens`."""

    def __init__(self, lm, layers: range, *, first: bool, last: bool):
        super().__init__()
        decoder = lm.model
        self.embed = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList(decoder.layers[i] for i in layers)
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm if last else None
        self.head = lm.lm_head if last else None

    def forward(self, x, position_ids, cu_seq_lens):
        h = self.embed(x) if self.embed is not None else x
        cu = _trim(cu_seq_lens)
        longest = int((cu[1:] - cu[:-1]).max())
        pe = self.rotary(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe,
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return self.norm(h) if self.norm is not None else h


def _skeleton(module: nn.Module) -> nn.Module:
    """`module` with every parameter and buffer replaced by a storage-less one of its shape (the meta device), its
    memory freed. By hand, not .to("meta"): a 4-bit base's Params4bit cannot be moved there."""
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    table[name] = nn.Parameter(empty, requires_grad=False) if table is m._parameters else empty
    return module


def _trim(cu: torch.Tensor) -> torch.Tensor:
    """A row's boundaries [0, l1, l1+l2, ..., T] from their fixed-length form (padded with T): on the CPU."""
    cu = cu.reshape(-1)
    n = int((cu[1:] > cu[:-1]).sum())
    return cu[: n + 1]


def fixed_row(batch: dict, slots: int, *, pad_id: int) -> dict[str, torch.Tensor]:
    """One packed micro-batch (CausalLM.collate's) as a row of exactly `slots` tokens: input_ids, position_ids,
    targets [1, slots] and cu_seq_lens [1, slots + 1], the padding one more segment that trains nothing."""
    ids, pos = batch["input_ids"].reshape(-1), batch["position_ids"].reshape(-1)
    n = len(ids)
    if n > slots:
        raise LLMTrainError(f"a packed micro-batch of {n} tokens is longer than train.micro_batch_tokens={slots}: "
                            "set data.max_seq_len to at most train.micro_batch_tokens")
    targets = torch.full((n,), IGNORE, dtype=torch.long)
    targets[batch["loss_index"]] = batch["loss_targets"]
    pad = slots - n
    cu = batch["cu_seq_lens"].to(torch.int32) if "cu_seq_lens" in batch else torch.tensor([0, n], dtype=torch.int32)
    cu = torch.cat([cu, torch.full((slots + 1 - len(cu),), slots, dtype=torch.int32)])  # the pad segment ends at T
    return {"input_ids": torch.cat([ids, torch.full((pad,), pad_id, dtype=ids.dtype)])[None],
            "position_ids": torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])[None],
            "targets": torch.cat([targets, torch.full((pad,), IGNORE, dtype=torch.long)])[None],
            "cu_seq_lens": cu[None]}


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class Pipeline:
    """This process's stages of the model and the schedule that runs a window through them."""

    def __init__(self, model, *, parallel, micro_batches: int, slots: int, pad_id: int, device):
        from torch.distributed import pipelining

        from llmtrain.model.loss import causal_lm

        g = pipeline_group()
        lm = causal_lm(model)
        config = lm.config
        if getattr(config, "tie_word_embeddings", False):
            raise LLMTrainError(
                f"parallel.pipeline_parallel={g.size}: this model ties its input embedding to its output head "
                "(tie_word_embeddings), and the first and the last stage would each hold and update their own copy "
                "of that one weight. Train it with FSDP (accelerate_configs/fsdp.yaml) or DDP instead")
        if getattr(config, "_attn_implementation", None) != "llmtrain_varlen":
            raise LLMTrainError(
                f"parallel.pipeline_parallel={g.size} attends within each packed row's examples with llmtrain's "
                "varlen attention (the boundaries travel to every stage); set model.attn_implementation=auto or varlen")
        chunks = parallel.stages_per_rank
        total = g.size * chunks
        ranges = stage_layers(config.num_hidden_layers, total)
        mine = [g.rank + k * g.size for k in range(chunks)]  # torch's loop order: virtual stage s on rank s % P
        self.modules = [Stage(lm, ranges[s], first=s == 0, last=s == total - 1) for s in mine]
        kept = {i for s in mine for i in ranges[s]}
        decoder = lm.model
        # what other stages hold, as shapes without storage (the meta device): put back for the export's names only
        self.elsewhere = [(decoder.layers, str(i)) for i in range(config.num_hidden_layers) if i not in kept]
        self.elsewhere += [(decoder, "embed_tokens")] if 0 not in mine else []
        self.elsewhere += [(decoder, "norm"), (lm, "lm_head")] if total - 1 not in mine else []
        self.skeletons = [_skeleton(getattr(parent, name)) for parent, name in self.elsewhere]
        for parent, name in self.elsewhere:
            setattr(parent, name, _Elsewhere())
        self.layers = {s: ranges[s] for s in mine}
        self.stages = [pipelining.PipelineStage(m, s, total, device, group=g.group)
                       for s, m in zip(mine, self.modules)]
        self.last = next((m for s, m in zip(mine, self.modules) if s == total - 1), None)
        self.first = 0 in mine
        schedule = getattr(pipelining, SCHEDULES[parallel.pipeline_schedule])
        stages = self.stages if parallel.pipeline_schedule == "interleaved_1f1b" else self.stages[0]
        self.schedule = schedule(stages, n_microbatches=micro_batches, loss_fn=self._loss, scale_grads=False)
        self.micro_batches, self.slots, self.pad_id, self.device = micro_batches, slots, pad_id, device
        self.scale: torch.Tensor | float = 1.0
        self.sums: list[torch.Tensor] = []  # the last stage's summed loss of each micro-batch of the step

    def describe(self) -> str:
        g = pipeline_group()
        runs = ", ".join(f"stage {s}: layers {r.start}-{r.stop - 1}" for s, r in self.layers.items())
        replicas = f" x {g.replicas} replicas" if g.replicas > 1 else ""
        return (f"pipeline parallelism: {g.size} stages{replicas}; this process: {runs} "
                f"({type(self.schedule).__name__}, {self.micro_batches} micro-batches of {self.slots} slots a step)")

    @contextmanager
    def whole(self):
        """The model with every module in place (other stages' as storage-less skeletons), for the export: peft and
        transformers name what they save from the modules they find."""
        held = [getattr(parent, name) for parent, name in self.elsewhere]
        for (parent, name), skeleton in zip(self.elsewhere, self.skeletons):
            setattr(parent, name, skeleton)
        try:
            yield
        finally:
            for (parent, name), module in zip(self.elsewhere, held):
                setattr(parent, name, module)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its summed cross-entropy (kept for the metrics) times the
        step's scale (1 / the window's trained tokens on every pipeline)."""
        flat, t = hidden.flatten(0, 1), targets.flatten()
        index = (t != IGNORE).nonzero().flatten()
        if index.numel() == 0:  # a placeholder row: a zero loss that still reaches the head
            loss = self.last.head(flat[:1], targets=t.new_zeros(1))[0] * 0.0
        else:
            loss = self.last.head(flat[index], targets=t[index])[0]
        self.sums.append(loss.detach())
        return loss * self.scale

    def run(self, batches: list[dict], *, scale) -> torch.Tensor:
        """Forward and backward of a window's micro-batches through the schedule; returns this process's summed
        loss (0 except on the last stage). `scale`: 1 / the window's loss units over every pipeline."""
        rows = [fixed_row(b, self.slots, pad_id=self.pad_id) for b in batches]
        while len(rows) < self.micro_batches:  # a short window (the end of the data): rows that train nothing
            rows.append(fixed_row({"input_ids": torch.tensor([self.pad_id]), "position_ids": torch.tensor([0]),
                                   "loss_index": torch.zeros(0, dtype=torch.long),
                                   "loss_targets": torch.zeros(0, dtype=torch.long)}, self.slots, pad_id=self.pad_id))
        stacked = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        self.scale, self.sums = scale, []
        args = (stacked["input_ids"].to(self.device),) if self.first else ()
        self.schedule.step(*args, target=stacked["targets"].to(self.device),
                           position_ids=stacked["position_ids"].to(self.device),
                           cu_seq_lens=stacked["cu_seq_lens"])  # the boundaries stay on the CPU (_trim reads them)
        self._sum_replicas()
        # the last M calls are the micro-batches': on its first step torch (2.13) also calls the loss function on
        # placeholder tensors to infer the gradients' shapes
        return torch.stack(self.sums[-self.micro_batches:]).sum() if self.sums else torch.zeros((), device=self.device)

    def parameters(self):
        seen = set()
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def _sum_replicas(self) -> None:
        """Data parallelism across pipelines: each stage's gradients summed over its replicas."""
        g = pipeline_group()
        if g.replicas == 1:
            return
        import torch.distributed as dist

        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=g.data_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the squared norms summed over the stages."""
        import torch.distributed as dist

        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = (torch.stack([torch.linalg.vector_norm(gr, dtype=torch.float32) ** 2 for gr in grads]).sum()
                   if grads else torch.zeros((), device=self.device))
        dist.all_reduce(squares, group=pipeline_group().group)
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


def write_stage(folder, model, optimizer, *, trainable_only: bool) -> None:
    """This process's stages' weights (the adapter's alone for LoRA) and optimizer state, by parameter name; only
    the first replica of each stage writes (the replicas hold the same)."""
    from safetensors.torch import save_file

    g = pipeline_group()
    if g.replica != 0:
        return
    out = folder / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    weights = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()
               if p.requires_grad or not trainable_only}
    save_file(weights, str(out / f"stage_{g.rank:03d}.safetensors"))
    names, state = _names(model), optimizer.state_dict()
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    torch.save({"state": {order[i]: s for i, s in state["state"].items()},
                "groups": [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]},
               out / f"stage_{g.rank:03d}_optimizer.pt")


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
            wanted[n].copy_(t)
    names, state = _names(model), optimizer.state_dict()
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state["state"] = {i: moments[n] for i, n in enumerate(order) if n in moments}
    for group in state["param_groups"]:  # the saved group of the same weight decay (decayed or not)
        saved = next(s for s in groups if s["weight_decay"] == group["weight_decay"])
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.load_state_dict(state)


def stage_files(folder) -> list:
    return sorted((folder / FOLDER).glob("stage_*.safetensors"))


def gather_state_dict(model, *, trainable_only: bool) -> dict:
    """The whole model's state dict (the adapter's alone for LoRA) on the main process, from every stage's first
    replica ({} elsewhere): for final/, which holds the whole model as every other run's does."""
    import torch.distributed as dist

    g = pipeline_group()
    mine = ({n: t.detach().cpu() for n, t in model.state_dict().items()
             if not trainable_only or n in {k for k, p in model.named_parameters() if p.requires_grad}}
            if g.replica == 0 else {})
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else {}
