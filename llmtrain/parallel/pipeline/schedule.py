"""A training step on pipeline stages (parallel.pipeline_parallel): this process's stages of the model
(stage.py, split by split.py) and the torch.distributed.pipelining schedule that runs a window's
micro-batches through them.

Fixed shapes. A stage receives its input into buffers whose shape it learns on the first step, so every micro-batch
is one packed row of exactly train.micro_batch_tokens slots (data/batching.fixed_row; online RL's passes,
rl.micro_batch_tokens; distillation's rows, train.micro_batch_size x data.max_seq_len: `row_slots`): the examples back
to back, then the padding as one more segment of its own (positions from 0, nothing trained). The examples'
boundaries go to every stage as a kwarg of one fixed length too (`cu_seq_lens` padded with its last value, trimmed in
each stage on the CPU): no shape ever changes between steps, so no buffer is stale or mis-sized.

The loss. The last stage's loss function is the run's chunked cross-entropy (model/loss.py) on the row's trained
positions, times 1 / (the window's trained tokens on every pipeline), with the schedule's `scale_grads=False`: the
sum over micro-batches and replicas of what each backpropagates is the gradient one process computes on the whole
window. The replicas' gradients are then summed over the data-parallel group, and the norm for clipping is the square
root of the squared norms summed over the stages (group.py). Objectives of whole sequences bring their own
last-stage loss (`head_loss`), its targets built from each micro-batch by it: a reward model's score head and pairs'
loss (objectives/reward_model.StageScores: its targets each sequence's index at its scored token), preference pairs'
per-sequence log-probabilities and loss (objectives/preference.StagePairs: each trained token's sequence, each
sequence's reference log-probability). Their reference is precomputed through the stages before training
(`sequence_logps`, forward only), as the schedule runs one pass a micro-batch. Online RL's (objectives/grpo.StageGRPO,
rloo.StageRLOO) carry each trained token's advantage and weight, its reference log-probability where GRPO's KL needs
it (`token_logps`, forward only before the step); distillation's (objectives/distill.StageDistill) reads the teacher's
hidden states its last stage kept for the window. Sampling through the stages: sampling.py (`Pipeline.sampling`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from llmtrain.capabilities import experts
from llmtrain.data.batching import batch_weight, collate, fixed_row, with_loss_positions
from llmtrain.data.formats import IGNORE
from llmtrain.errors import LLMTrainError
from llmtrain.model.attention import NAME as VARLEN
from llmtrain.model.loss import causal_lm, eval_counts, logit_transform
from llmtrain.parallel.pipeline.group import PipelineGroup, clip_grad_norm_, ends_group, sum_replicas, sum_tied
from llmtrain.parallel.pipeline.split import rank_stages, stage_layers
from llmtrain.parallel.pipeline.stage import (PER_LAYER_MODULES, Balance, Elsewhere, Stage, cut_points, head_name,
                                              skeleton)

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def row_slots(recipe) -> tuple[int, str]:
    """The slots of the stages' one row shape and the setting they are: train.micro_batch_tokens, which every mode on
    stages sets (capabilities' rule; a KTO micro-batch's KL sequences, each a prompt with another's completion, hold
    as many tokens as its completions' sequences at most, so they fit the same row); online RL's passes,
    rl.micro_batch_tokens (its micro-batches are prompts, its rows their completions' passes); distillation's
    micro-batches of rows, train.micro_batch_size x data.max_seq_len (the longest they pack to)."""
    if recipe.rl is not None:
        return recipe.rl.micro_batch_tokens, "rl.micro_batch_tokens"
    if recipe.distill is not None:  # micro-batches of rows (no token budget): as long as they can be
        return recipe.train.micro_batch_size * recipe.data.max_seq_len, "train.micro_batch_size x data.max_seq_len"
    return recipe.train.micro_batch_tokens, "train.micro_batch_tokens"


def _quiet_shape_inference(stage, device) -> None:
    """torch 2.11 (the GPU machine's) learns a stage's shapes at the schedule's first run by calling the stage on
    zeros of its inputs' shapes, in training mode under no_grad: what draws random numbers there (NEFTune's noise,
    LoRA's dropout) advanced the process's generator, so every later draw came one late (measured: NEFTune on 2 stages
    4e-2 off one process's first loss). Run it on a forked generator (CPU and the stage's GPU). torch 2.13 has no such
    call."""
    infer = getattr(stage, "_shape_inference", None)
    if infer is None:
        return

    def forked(*args, **kwargs):
        with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
            return infer(*args, **kwargs)

    stage._shape_inference = forked


def receiving_gradients(stages) -> None:
    """Make every buffer the stages receive activations into need a gradient, before a training run of the schedule.
    torch 2.11 (the GPU machine's) makes them once, at the schedule's first run, needing one only if that run
    trains; where the first run was forward only (a reference or KL pass, an eval before the first step) the next
    stage's backward left the received hidden states without a gradient, and the schedule failed ("has gradients None
    and is expecting to send gradients to stage 0", measured: DPO and KTO on 2 stages). torch 2.13 remakes them."""
    for stage in stages:
        for infos in getattr(stage, "args_recv_info", {}).values():
            for info in infos:
                buffer = getattr(info, "buffer", None)  # (none: the first stage's inputs, given by the caller)
                if getattr(info, "is_root_arg", False) or not isinstance(buffer, torch.Tensor):
                    continue
                if buffer.is_floating_point() and not buffer.requires_grad:
                    buffer.requires_grad_(True)


class Pipeline:
    """This process's stages of the model and the schedule that runs a window through them."""

    def __init__(self, model, *, parallel, micro_batches: int, slots: int, pad_id: int, device,
                 group: PipelineGroup, fsdp=None, precision=nullcontext, head_loss=None,
                 slots_key: str = "train.micro_batch_tokens", router_aux: float | None = None,
                 fp32_head: bool = False, loss_scaler=None):
        """`fsdp`: None, or the FSDP launch's MixedPrecisionPolicy (or True without one): each stage is then sharded
        over its replicas (FSDP2's fully_shard on each decoder layer and on the stage), kept unsharded between its
        forward and backward as torchtitan does under pipelining (reshard_after_forward=False: the schedule runs
        several micro-batches' forwards before their backwards). `precision`: the run's autocast, around each
        stage's forward and the loss (the stages are not prepared by Accelerate, which would put it there). `group`:
        this process's pipeline (parallel/groups.py). `head_loss`: an objective's last-stage loss
        (objectives/reward_model.StageScores, preference.StagePairs, kto.StageKTO, grpo.StageGRPO, rloo.StageRLOO,
        distill.StageDistill); None: the LM head's cross-entropy. `slots_key`: the setting `slots` is (row_slots).
        `router_aux` (model.router_aux_loss_coef): a mixture of experts' load-balancing loss joins the last stage's
        loss with this weight, times each row's trained tokens (the LM head's cross-entropy, as loss.attach_loss adds
        it) or its pairs or examples (the head loss's `units`: preference pairs, KTO), its statistic last: the stages
        hand its sums on beside the hidden states (stage.Balance). `fp32_head` (rl.cast_lm_head_to_fp32): under FSDP
        the last stage's head is a unit of its own, gathered and reduced in fp32 (fsdp.fp32_policy), where the
        stage's policy would gather it in bf16. `loss_scaler`: fp16's dynamic loss scale (Accelerate's GradScaler,
        which its checkpoint saves), or None: the last stage's loss is scaled by it, each stage unscales its own
        gradients, and the global norm's verdict settles every stage's scale alike (`unscale`, `update_scale`)."""
        import torch.distributed as dist
        from torch.distributed import pipelining

        g = self.group = group
        lm = causal_lm(model)
        config = lm.config
        # too few layers: refused with the rest of the layout (capabilities.model_problems)
        if getattr(config, "_attn_implementation", None) != VARLEN:
            raise LLMTrainError(
                f"parallel.pipeline_parallel={g.size} attends within each packed row's examples with llmtrain's "
                "varlen attention (the boundaries travel to every stage); set model.attn_implementation=auto or varlen")
        chunks = parallel.stages_per_rank
        total = g.size * chunks
        try:
            ranges = stage_layers(config.num_hidden_layers, total)
        except ValueError as e:
            raise LLMTrainError(f"{e}: lower parallel.pipeline_parallel (or pipeline_chunks)") from None
        mine = rank_stages(g.rank, g.size, chunks)  # torch's loop order: virtual stage s on rank s % P
        # a tied embedding (Llama 3.2, Gemma 3, small Qwen3): the first stage reads it as the embedding, the last as
        # the head, each its own copy of the one weight; their gradients are summed after each step (group.sum_tied)
        head = lm.get_output_embeddings()  # None: a reward model's score head
        tied = head is not None and head.weight is lm.get_input_embeddings().weight
        self.ends = ends_group(g) if tied else None
        # what sampling on the stages (sampling.StagesLM) reads of the model, before other stages' modules go (a
        # reward model's score head samples nothing: it has no LM head to read a transform of)
        self.config, self.supports_sdpa = config, getattr(type(lm), "_supports_sdpa", True)
        self.logits = logit_transform(lm) if head is not None else None
        self.vocab = head.weight.shape[0] if head is not None else None
        self.router_aux = router_aux
        self.modules = [Stage(lm, ranges[s], first=s == 0, last=s == total - 1, precision=precision,
                              balanced=router_aux is not None) for s in mine]
        self.experts = experts(config)
        self.precision = precision
        self.order = {id(p): i for i, p in enumerate(model.parameters())}  # the whole model's, for the norm
        kept = {i for s in mine for i in ranges[s]}
        decoder = lm.model
        # what other stages hold, as shapes without storage (the meta device): put back for the export's names only
        self.elsewhere = [(decoder.layers, str(i)) for i in range(config.num_hidden_layers) if i not in kept]
        per_layer = PER_LAYER_MODULES if getattr(config, "hidden_size_per_layer_input", None) else ()
        self.elsewhere += [(decoder, n) for n in ("embed_tokens", *per_layer)] if 0 not in mine else []
        self.elsewhere += [(decoder, "norm"), (lm, head_name(lm))] if total - 1 not in mine else []
        self.skeletons = [skeleton(getattr(parent, name)) for parent, name in self.elsewhere]
        for parent, name in self.elsewhere:
            setattr(parent, name, Elsewhere())
        self.layers = {s: ranges[s] for s in mine}
        self.sharded = fsdp is not None and g.replicas > 1
        self.unsharded_fsdp = fsdp is not None and g.replicas == 1  # an FSDP launch of one process a stage
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            from llmtrain.parallel.fsdp import fp32_policy

            policy = {} if fsdp is True else {"mp_policy": fsdp}
            for m in self.modules:
                for layer in m.layers:
                    fully_shard(layer, mesh=g.mesh["dp"], reshard_after_forward=False, **policy)
                if fp32_head and m.head is not None:
                    fully_shard(m.head, mesh=g.mesh["dp"], reshard_after_forward=False, mp_policy=fp32_policy())
                fully_shard(m, mesh=g.mesh["dp"], reshard_after_forward=False, **policy)
        # (read after fully_shard, which puts DTensor parameters in the modules' place)
        held = [m.embed.weight for m in self.modules if m.embed is not None] + \
            [m.head.weight for m in self.modules if m.head is not None]
        self.tied = [p for p in held if p.requires_grad] if tied else []  # frozen under LoRA: nothing to sum
        self.stages = [pipelining.PipelineStage(m, s, total, device, group=g.group)
                       for s, m in zip(mine, self.modules)]
        for stage in self.stages:
            _quiet_shape_inference(stage, device)
        self.by_stage = dict(zip(mine, self.modules))
        self.stage_ranks = [dist.get_global_rank(g.group, s % g.size) for s in range(total)]  # who runs stage s
        self.last = next((m for s, m in zip(mine, self.modules) if s == total - 1), None)
        self.first = 0 in mine
        schedule = getattr(pipelining, SCHEDULES[parallel.pipeline_schedule])
        stages = self.stages if parallel.pipeline_schedule == "interleaved_1f1b" else self.stages[0]
        self.schedule = schedule(stages, n_microbatches=micro_batches, loss_fn=self._loss, scale_grads=False)
        self.micro_batches, self.slots, self.pad_id, self.device = micro_batches, slots, pad_id, device
        self.slots_key = slots_key
        self.scale: torch.Tensor | float = 1.0
        self.loss_scaler = loss_scaler
        self.sums: list[torch.Tensor] = []  # the last stage's summed loss of each micro-batch of the step
        self.stats: list[torch.Tensor] = []  # and its statistics (a reward model's; none for the LM head's loss)
        self.head_loss = head_loss
        self.forward_only = None  # evaluating, or the reference pass: what the loss function returns instead

    def describe(self) -> str:
        g = self.group
        runs = ", ".join(f"stage {s}: layers {r.start}-{r.stop - 1}" for s, r in self.layers.items())
        replicas = (f" x {g.replicas} {'FSDP shards' if self.sharded else 'replicas'}" if g.replicas > 1 else
                    " (the FSDP launch has one process a stage: no replica to shard over, each stage whole)"
                    if self.unsharded_fsdp else "")
        rows = (f"{self.micro_batches} micro-batches of {self.slots} slots a step" if self.slots_key.startswith("train")
                else f"the rollout's passes of {self.slots} slots ({self.slots_key}), {self.micro_batches} at a time; "
                     "sampled through the stages")
        return f"pipeline parallelism: {g.size} stages{replicas}; this process: {runs} " \
               f"({type(self.schedule).__name__}, {rows})"

    @contextmanager
    def whole(self):
        """The model with every module in place (other stages' as storage-less skeletons), for the export: peft and
        transformers name what they save from the modules they find."""
        held = [getattr(parent, name) for parent, name in self.elsewhere]
        for (parent, name), shape in zip(self.elsewhere, self.skeletons):
            setattr(parent, name, shape)
        try:
            yield
        finally:
            for (parent, name), module in zip(self.elsewhere, held):
                setattr(parent, name, module)

    @contextmanager
    def sampling(self):
        """The stages as one causal LM that model/generate.sample decodes with (sampling.StagesLM), inside the block:
        in eval mode, and sharded stages gathered once for the whole block (each decoding step would otherwise
        gather every layer); train mode and the shards put back after."""
        from contextlib import ExitStack

        from llmtrain.parallel.fsdp import gathered_for_generation
        from llmtrain.parallel.pipeline.sampling import StagesLM

        was = [m.training for m in self.modules]
        try:
            with ExitStack() as held:
                for m in self.modules:
                    m.eval()
                    if self.sharded:
                        held.enter_context(gathered_for_generation(m))
                yield StagesLM(self)
        finally:
            for m, mode in zip(self.modules, was):
                m.train(mode)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its summed loss (kept for the metrics) times the step's scale
        (1 / the window's loss units on every pipeline). Forward only (`forward_only`), what that function returns of
        the micro-batch instead: its eval sums (evaluate), its sequences' log-probabilities (sequence_logps)."""
        balance = None
        if self.router_aux is not None:  # the stages' load-balancing sums beside the hidden states
            hidden, sums = hidden
            balance = Balance.whole(sums, self.experts)
        with self.precision():
            if self.forward_only is not None:
                return self.forward_only(hidden, targets)
            if self.head_loss is not None:  # the objective's own: the head on each sequence's positions
                loss, stats = self.head_loss.loss(self.last.head, hidden.flatten(0, 1), targets.flatten(0, 1))
                if balance is not None:  # times the row's pairs or examples, as Preference.loss and KTO.loss add it
                    units = self.head_loss.units(targets.flatten(0, 1))
                    loss = loss + self.router_aux * balance * units
                    stats = torch.cat([stats, (balance.detach() * units).reshape(1)])
                self.sums.append(loss.detach())
                self.stats.append(stats)
                return loss * self.scale
            return self._train_loss(hidden, targets, balance)

    def _train_loss(self, hidden: torch.Tensor, targets: torch.Tensor, balance=None) -> torch.Tensor:
        flat, t = hidden.flatten(0, 1), targets.flatten()
        index = (t != IGNORE).nonzero().flatten()
        if index.numel() == 0:  # a placeholder row: a zero loss that still reaches the head
            loss = self.last.head(flat[:1], targets=t.new_zeros(1))[0] * 0.0
        else:
            loss = self.last.head(flat[index], targets=t[index])[0]
        if balance is not None:  # the row's load-balancing loss times its trained tokens (its aux_loss statistic;
            # a filler row's 0 still reaches the sums, whose gradient every stage receives)
            loss = loss + self.router_aux * balance * index.numel()
            self.stats.append((balance.detach() * index.numel()).reshape(1))
        self.sums.append(loss.detach())
        return loss * self.scale

    def _eval_sums(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[loss, trained tokens, argmax hits, teacher-forced matches, examples] of one row, as CausalLM.eval_sums
        counts them (float64), from targets that carry each position's example beside its token; an objective's own
        eval sums where it brings its head's loss."""
        if self.head_loss is not None:
            return self.head_loss.eval_sums(self.last.head, hidden.flatten(0, 1), targets.flatten(0, 1))
        flat, t, example = hidden.flatten(0, 1), targets[..., 0].flatten(), targets[..., 1].flatten()
        index = (t != IGNORE).nonzero().flatten()
        if index.numel() == 0:
            return torch.zeros(5, dtype=torch.float64, device=hidden.device)
        loss, hits = self.last.head(flat[index], targets=t[index], with_hits=True)
        example = example[index]
        return eval_counts(loss, hits, example, int(example.max()) + 1)

    def _rows(self, batches: list[dict]) -> dict[str, torch.Tensor]:
        """The micro-batches as M rows of the fixed shape (a short list filled with rows that train nothing; an idle
        replica's stand-in is such a row too: every row costs the same slots, and this one adds nothing)."""
        idle = with_loss_positions(collate([], pad_id=self.pad_id, packing=True))
        filled = [b if batch_weight(b) else idle for b in batches] + [idle] * (self.micro_batches - len(batches))
        rows = [self._row(b) for b in filled]
        stacked = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        # each row's real tokens: the load-balancing loss's (its padding routes through the experts too), NEFTune's
        # (it draws noise for those alone)
        stacked["real"] = torch.tensor([b["input_ids"].numel() for b in filled])
        return stacked

    def _kwargs(self, stacked: dict) -> dict:
        """What every stage's forward takes of the rows beside the hidden states: the positions (on the device), the
        boundaries (on the CPU: each stage trims them), and each row's real tokens (CPU)."""
        return {"position_ids": stacked["position_ids"].to(self.device), "cu_seq_lens": stacked["cu_seq_lens"],
                "real": stacked["real"]}

    def _row(self, batch: dict) -> dict[str, torch.Tensor]:
        """One micro-batch as a row of the fixed shape; an objective's own head loss builds its targets."""
        if self.head_loss is None:
            return fixed_row(batch, self.slots, pad_id=self.pad_id, key=self.slots_key)
        none = torch.zeros(0, dtype=torch.long)
        row = fixed_row({**batch, "loss_index": none, "loss_targets": none}, self.slots, pad_id=self.pad_id,
                        key=self.slots_key)
        return {**row, "targets": self.head_loss.targets(batch, self.slots)}

    def _forward_only(self, batches: list[dict], fn) -> list[torch.Tensor]:
        """`fn(hidden, targets)` of each of up to M micro-batches' rows, forward only through the stages: the last
        stage's M results (filler rows' among them), none on the others."""
        stacked = self._rows(batches)
        target = stacked["targets"]  # an objective's own head loss: its targets already
        if self.head_loss is None:  # beside each position's target, its example: its segment of the row (the
            # padding's positions are never trained)
            example = torch.stack([torch.bucketize(torch.arange(self.slots), cut_points(cu).long(), right=True) - 1
                                   for cu in stacked["cu_seq_lens"]])
            target = torch.stack([target, example], dim=-1)
        self.forward_only, out = fn, []
        try:
            args = (stacked["input_ids"].to(self.device),) if self.first else ()
            self.schedule.eval(*args, target=target.to(self.device), losses=out, **self._kwargs(stacked),
                               return_outputs=False)
        finally:
            self.forward_only = None
        return out

    def _prepared(self, batches: list[dict]) -> list[dict]:
        """The micro-batches with what an objective's head loss computes of them through the stages first (its
        `prepare`: KTO's reference log-probabilities and KL estimates, forward only); as they are otherwise."""
        prepare = getattr(self.head_loss, "prepare", None)
        return prepare(self, batches) if prepare is not None else batches

    def evaluate(self, batches: list[dict]) -> torch.Tensor:
        """The eval sums of up to M micro-batches, forward only through the stages; zeros except on the last."""
        sums = self._forward_only(self._prepared(batches), self._eval_sums)
        size = self.head_loss.eval_size if self.head_loss is not None else 5
        return torch.stack(sums).sum(0) if sums else torch.zeros(size, dtype=torch.float64, device=self.device)

    def sequence_logps(self, batches: list[dict]) -> list[torch.Tensor] | None:
        """Each of up to M micro-batches' sequences' summed answer log-probabilities ([slots] each, zeros after its
        sequences: objectives/preference.StagePairs.logps), forward only through the stages, with the model as it is
        (a preference run's reference pass); None except on the last stage."""
        out = self._forward_only(batches, lambda hidden, targets: self.head_loss.logps(
            self.last.head, hidden.flatten(0, 1), targets.flatten(0, 1)))
        return out[-self.micro_batches:][:len(batches)] if self.last is not None else None  # the fillers' dropped

    def run(self, batches: list[dict], *, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of a window's micro-batches through the schedule; returns this process's summed
        loss and statistics (0 except on the last stage). `scale`: 1 / the window's loss units over every
        pipeline. More than M micro-batches (online RL's passes: as many as its completions fill) run through the
        schedule M at a time, their gradients adding up before the one optimizer step."""
        prepared = self._prepared(batches)
        # FSDP's reduce-scatter averages the replicas' gradients, where the loss wants their sum
        self.scale = scale * (self.group.replicas if self.sharded else 1)
        if self.loss_scaler is not None:  # fp16: times the loss scale (GradScaler.scale, as Accelerate's backward
            # scales one process's loss; a power of 2, so the product is exact)
            self.scale = self.loss_scaler.scale(torch.tensor(self.scale, device=self.device))
        m, sums, stats = self.micro_batches, [], []
        receiving_gradients(self.stages)
        for start in range(0, max(len(prepared), 1), m):
            stacked = self._rows(prepared[start:start + m])  # a short window: filled with rows that train nothing
            self.sums, self.stats = [], []
            args = (stacked["input_ids"].to(self.device),) if self.first else ()
            # the boundaries stay on the CPU (each stage trims them). return_outputs=False: the last stage would
            # otherwise keep every micro-batch's final hidden states until the next step (torch's output_chunks, for
            # step()'s merged return, which nothing reads): M - 1 x tokens x hidden more at its peak (measured:
            # tests/stage_peak.py)
            self.schedule.step(*args, target=stacked["targets"].to(self.device), **self._kwargs(stacked),
                               return_outputs=False)
            # the last M calls are the micro-batches': on its first step torch (2.13) also calls the loss function
            # on placeholder tensors to infer the gradients' shapes
            sums += self.sums[-m:]
            stats += self.stats[-m:]
        if self.tied:
            sum_tied(self.tied, self.ends)
        if not self.sharded:
            sum_replicas(self.parameters(), self.group)
        size = (self.head_loss.stats if self.head_loss is not None else 0) + int(self.router_aux is not None)
        stats = torch.stack(stats).sum(0) if stats else torch.zeros(size, device=self.device)
        return (torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)), stats

    def from_last(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the pipeline's last stage holds it, on every stage of the pipeline (one broadcast): what the last
        stage alone computes and every stage needs (RLOO's KL of each completion, in its rewards)."""
        import torch.distributed as dist

        out = t.to(self.device).contiguous()
        dist.broadcast(out, src=self.stage_ranks[-1], group=self.group.group)
        return out.to(t.device)

    def token_logps(self, batches: list[dict]) -> list[torch.Tensor] | None:
        """Each micro-batch's trained tokens' log-probabilities, each at its slot of the row ([slots] each: the
        objective's head loss's `token_logps`), forward only through the stages M at a time, with the model as it
        is (online RL's reference pass); None except on the last stage."""
        out, m = [], self.micro_batches
        runs = -(-len(batches) // m)
        if self.sharded:  # FSDP over the replicas: every pipeline runs the schedule as often, so that the all-gathers
            # torch's schedule makes (a stage resharded when it turns from training to evaluation) line up; the
            # pipelines' own numbers of passes differ (online RL's rollout: as many as its completions fill)
            import torch.distributed as dist

            most = torch.tensor([runs], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group.data_group)
            runs = int(most)
        for r in range(runs):  # (a run past this pipeline's passes: rows that train nothing)
            chunk = batches[r * m:(r + 1) * m]
            got = self._forward_only(chunk, lambda hidden, targets: self.head_loss.token_logps(
                self.last.head, hidden.flatten(0, 1), targets.flatten(0, 1)))
            out += got[-m:][:len(chunk)]
        return out if self.last is not None else None

    def parameters(self):
        seen = set()
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def unscale(self, optimizer) -> None:
        """fp16: this stage's gradients divided by the loss scale (GradScaler.unscale_, which also notes whether any
        is not finite here), before the global norm."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(optimizer)

    def update_scale(self, optimizer, skipped: bool) -> None:
        """fp16: the loss scale's update after the step (halved where the update was skipped, grown after
        growth_interval good steps), on every stage by the global norm's verdict (`skipped`), not by its own
        gradients' alone: one stage's overflow skips every stage's update, and the scales stay one. GradScaler
        reads the verdict from what unscale_ noted (its _per_optimizer_states, which torch has kept so since 1.6)."""
        if self.loss_scaler is None:
            return
        for found in self.loss_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            found.fill_(float(skipped))
        self.loss_scaler.update()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(list(self.parameters()), max_norm, self.device, sharded=self.sharded, g=self.group,
                               order=self.order, uncounted=[] if self.first else self.tied)  # the first counts it
