"""KTO (Kahneman-Tversky Optimization, Ethayarajh et al. 2024) on unpaired feedback, as TRL 1.16's KTOTrainer
computes it, padding-free on the same loop, step and metering as supervised fine-tuning.

A micro-batch holds n examples (prompt + completion, a boolean label each) and, for loss_type kto, n KL sequences:
TRL's mismatched pairs, each prompt with the previous example's completion, the first with the last's
((x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})), truncated to data.max_seq_len. A sequence's log-probability is the
sum over its completion tokens (up to and including the end of turn) of log p(token), from the final hidden states
chunk by chunk (loss.compute_loss(per_token=True)), as preference.py takes them.

The loss, TRL's `kto_loss`: z = max(0, mean over the micro-batch of (policy - reference) log-probabilities of the KL
sequences), detached; a desirable completion costs desirable_weight (1 - sigmoid(beta (logratio - z))), an
undesirable one undesirable_weight (1 - sigmoid(beta (z - logratio))); apo_zero_unpaired: 1 - sigmoid(beta
logratio) and sigmoid(beta logratio), no KL. TRL takes the mean over the micro-batch's examples; here the step
divides the sum by the examples of the window (Counts.units = examples), the same on one micro-batch.

The KL estimate under several processes, as TRL's `gather_for_metrics(kl).mean()`: each process's mean over its own
micro-batch's KL sequences, averaged over the processes (one all-reduce of [mean, 1] a micro-batch: collectives.
device_sum), then clamped. An idle rank at the end of an epoch runs a stand-in (batching.StandIn) with weight 0 and
adds [0, 0]: the average is over the processes that have a micro-batch. Under gradient
accumulation each micro-batch has its own estimate, as TRL's.

The reference: with lora:, the same model with the adapter disabled, under no_grad (no copy of the weights); a full
fine-tune keeps a frozen copy of the starting weights (model/reference.py, made before a resume loads a checkpoint
into the policy; kto.sync_reference mixes the policy into it, TRL's sync_ref_model), as TRL's KTOTrainer loads its
ref_model. Precomputing the reference (TRL's precompute_ref_log_probs) would
need the KL pairs before training, and here they follow each epoch's shuffled micro-batches; a copy costs one more
set of weights (in the estimate) and no extra passes over the data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtrain.data.batching import Counts, batch_weight, collate, to_device, with_loss_positions
from llmtrain.data.formats import IGNORE, prompt_length
from llmtrain.model.reference import forward_of
from llmtrain.objectives.preference import StagePairs, eval_row, policy_logps, sequence_logps

# Statistics summed over the window (and processes); step_metrics turns them into TRL's names.
SUMS = ["chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps", "chosen", "rejected", "kl"]
STATS = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"]


def kto_losses(kind: str, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor | None, *, beta: float, desirable_weight: float,
               undesirable_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example weighted losses and implicit rewards beta (logp - ref) (detached), from the summed completion
    log-probabilities of the policy and the reference, the labels (bool) and the clamped, detached KL estimate."""
    ratio = logps - ref_logps
    if kind == "kto":
        desired = 1 - F.sigmoid(beta * (ratio - kl))
        undesired = 1 - F.sigmoid(beta * (kl - ratio))
    elif kind == "apo_zero_unpaired":
        desired, undesired = 1 - F.sigmoid(beta * ratio), F.sigmoid(beta * ratio)
    else:
        raise ValueError(f"unknown KTO loss {kind!r}")
    losses = torch.where(desirable, desirable_weight * desired, undesirable_weight * undesired)
    return losses, beta * ratio.detach()


def kl_sequences(examples: list[dict], max_seq_len: int) -> list[dict]:
    """TRL's mismatched pairs: example i's prompt with example i-1's whole completion (the first's with the last's),
    ids and labels, cut to max_seq_len. The prompt is what comes before an example's first trained label; the whole
    completion is the row's with what max_seq_len cut off its end (cut_ids: it had been the cut row's, so a shorter
    prompt took fewer of its tokens than TRL's: a KL estimate of 0.011 for TRL's 0.196, audit 21)."""
    def split(e):
        labels = list(e["labels"])
        start = prompt_length(labels)
        return (list(e["input_ids"][:start]), list(e["input_ids"][start:]) + list(e.get("cut_ids") or ()),
                labels[start:] + list(e.get("cut_labels") or ()))

    parts = [split(e) for e in examples]
    out = []
    for i, (prompt, _, _) in enumerate(parts):
        _, ids, labels = parts[i - 1]
        out.append({"input_ids": (prompt + ids)[:max_seq_len],
                    "labels": ([IGNORE] * len(prompt) + labels)[:max_seq_len]})
    return out


class KTO:
    """The KTO objective (objective.Objective): labelled completions in, TRL's KTO loss out."""

    whole_sequences = True  # its loss reads each sequence's whole log-probability (parallel/sequence/shards.py)
    sequence_sum = None  # sequence parallelism: a sequence's log-probability from its slices' parts
    expected_rows = "label"  # train.eval_samples: the rows whose completion is a reply to expect (the desirable)

    def __init__(self, cfg, *, pad_id: int, packing: bool, max_seq_len: int, model=None, reference=None,
                 reduce=None, router_aux: float | None = None):
        self.cfg, self.pad_id, self.packing, self.max_seq_len = cfg, pad_id, packing, max_seq_len
        # model.router_aux_loss_coef: the policy pass's load-balancing loss joins the loss, as TRL's KTOTrainer adds it
        self.router_aux = router_aux
        self.model = model  # unwrapped (no DDP forward, so no collective): the KL pass, and the LoRA reference
        # model/reference.py's: a full fine-tune's frozen copy, or LoRA's moving adapter; None: the adapter disabled
        self.reference = reference
        self.reduce = reduce  # a device tensor summed over processes (collectives.device_sum); None: one process
        self.columns = ("input_ids", "labels", "label", "cut_ids", "cut_labels")

    def _collate(self, sequences: list[dict]) -> dict:
        batch = with_loss_positions(collate(sequences, pad_id=self.pad_id, packing=self.packing))
        batch["sequence_tokens"] = torch.bincount(batch["loss_example"], minlength=len(sequences)).float()
        return batch

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        sequences = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        batch = self._collate(sequences)
        batch["desirable"] = torch.tensor([bool(e["label"]) for e in examples], dtype=torch.bool)
        kl = kl_sequences(examples, self.max_seq_len) if self.cfg.loss_type == "kto" and examples else []
        if kl:  # flat, under "kl:" names: the loop moves and pins a batch's own tensors, not nested ones
            batch.update({f"kl:{k}": v for k, v in self._collate(kl).items()})
        # tokens (tokens/s, tokens_seen, the MFU's FLOPs) are the rows' own: the KL sequences, forwarded without a
        # gradient, count no more than a reference's forward does (they had doubled tokens_seen; TRL's num_tokens)
        return batch, Counts.of(sequences, units=len(examples), trained=len(batch["loss_index"]))

    def _reference(self, batch: dict) -> torch.Tensor:
        """The reference's summed completion log-probabilities, under no_grad."""
        model, context = forward_of(self.model, self.reference)
        with torch.no_grad(), context:
            return self.logps(model, batch)

    def logps(self, model, batch: dict) -> torch.Tensor:
        """sequence_logps of the batch's sequences, whole (summed over a sequence group), as Preference.logps."""
        return sequence_logps(model, batch, total=self.sequence_sum)

    def _kl(self, batch: dict) -> torch.Tensor | None:
        """TRL's KL estimate: the mean over the KL sequences of (policy - reference) log-probabilities, averaged over
        the processes, no grad, at least 0. An idle rank's stand-in (weight 0) takes part in the average with
        nothing. None for apo_zero_unpaired."""
        if self.cfg.loss_type != "kto":
            return None
        kl = {k[3:]: v for k, v in batch.items() if k.startswith("kl:")}
        with torch.no_grad():
            # the policy's pass is the unwrapped model's: a DDP forward would be a collective of its own
            policy = self.logps(self.model, kl)
            one = torch.ones((), device=batch["input_ids"].device)
            mean = torch.stack([(policy - self._reference(kl)).mean(), one]) * batch_weight(batch)
            if self.reduce is not None:  # TRL's gather_for_metrics(kl).mean(): every process's mean, averaged
                mean = self.reduce(mean)
        return (mean[0] / mean[1].clamp(min=1)).clamp(min=0)

    def loss(self, model, batch: dict, *, aux: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples' summed loss and statistics; under model.router_aux_loss_coef (and `aux`: training), plus the
        weight times the load-balancing loss of the completions' pass (not the KL sequences') times the examples,
        and that times the examples last among the statistics (as Preference.loss)."""
        kl = self._kl(batch)  # no-grad forwards first: they leave no graph behind
        ref = self._reference(batch)
        logps, router, _, _ = policy_logps(model, batch, self.router_aux, aux=aux, total=self.sequence_sum)
        desirable = batch["desirable"]
        losses, rewards = kto_losses(self.cfg.loss_type, logps, ref, desirable, kl, beta=self.cfg.beta,
                                     desirable_weight=self.cfg.desirable_weight,
                                     undesirable_weight=self.cfg.undesirable_weight)
        with torch.no_grad():
            d, u = desirable.float(), (~desirable).float()
            n = float(desirable.numel())
            stats = torch.stack([(rewards * d).sum(), (rewards * u).sum(), (logps.detach() * d).sum(),
                                 (logps.detach() * u).sum(), d.sum(), u.sum(),
                                 (kl if kl is not None else logps.new_zeros(())) * n]
                                + ([router.detach().float() * n] if router is not None else []))
        return losses.sum() + (self.router_aux * router * n if router is not None else 0.0), stats

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        """TRL's metrics: rewards and log-probabilities averaged over the desirable (chosen) and undesirable
        (rejected) completions apart (a side with none is left out, as TRL leaves it), margins where both are,
        and kl, the micro-batches' estimates averaged over the examples."""
        chosen_r, rejected_r, chosen_l, rejected_l, chosen, rejected, kl, *router = stats
        out = {"kl": kl / max(units, 1), **({"aux_loss": router[0] / max(units, 1)} if router else {})}
        if chosen:
            out.update({"rewards/chosen": chosen_r / chosen, "logps/chosen": chosen_l / chosen})
        if rejected:
            out.update({"rewards/rejected": rejected_r / rejected, "logps/rejected": rejected_l / rejected})
        if chosen and rejected:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        examples = batch["sequence_tokens"].numel()
        loss, stats = self.loss(model, to_device(batch, device), aux=False)  # evaluation: the KTO loss alone
        return torch.cat([loss.detach().reshape(1), stats, loss.new_tensor([examples])]).double()

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, *stats, examples = sums
        return {"eval_loss": loss / max(examples, 1),
                **{f"eval_{k}": v for k, v in self.step_metrics(stats, examples).items()}}


class StageKTO(StagePairs):
    """KTO on pipeline stages (parallel/pipeline/schedule.py): the last stage's loss, KTO's own (kto_losses). Before a
    window's training pass (and an eval's), `prepare` runs forward-only passes of its micro-batches through the
    stages: the completions with the adapter disabled (the reference: LoRA's, as StagePairs' adapter reference), then
    each micro-batch's KL sequences with the policy and with the adapter disabled. Each micro-batch's KL estimate
    (TRL's: the mean over its KL sequences of policy - reference, averaged over the data-parallel replicas' last
    stages, at least 0, as KTO._kl) and each completion's reference log-probability then travel to the last stage in
    the targets: StagePairs' columns (token, sequence, reference, trained tokens, weight), and after them at slot k
    the k-th completion's label, at every slot the KL estimate."""

    stats = len(SUMS)
    eval_size = len(SUMS) + 2  # [loss, statistics, examples], as KTO.eval_sums

    def __init__(self, cfg, *, adapter_off, reduce=None):
        super().__init__(cfg, reference="adapter", adapter_off=adapter_off)
        self.reduce = reduce

    def units(self, target: torch.Tensor) -> int:
        """The row's completions (KTO.loss weighs the load-balancing loss by its examples)."""
        return int((target[:, 3] >= 0).sum())

    def targets(self, batch: dict, slots: int) -> torch.Tensor:
        out = torch.cat([super().targets(batch, slots), torch.zeros(1, slots, 2)], dim=-1)
        if (desirable := batch.get("desirable")) is not None:
            out[0, : len(desirable), self.WIDTH] = desirable.float()
        if "kl" in batch:
            out[0, :, self.WIDTH + 1] = float(batch["kl"])
        return out

    def prepare(self, pipeline, batches: list[dict]) -> list[dict]:
        """The window's micro-batches with their completions' reference log-probabilities (StagePairs.prepare) and
        their KL estimates (forward only, through the stages; every process takes part, the last stage alone holds
        the log-probabilities)."""
        batches = super().prepare(pipeline, batches)
        if self.cfg.loss_type != "kto":
            return batches
        rows = [{**{k[3:]: v for k, v in b.items() if k.startswith("kl:")}, "batch_weight": batch_weight(b)}
                for b in batches]
        with torch.no_grad():  # (no graph kept by the passes' cached outputs)
            policy = pipeline.sequence_logps(rows)
            with self.adapter_off():
                reference = pipeline.sequence_logps(rows)
        # [mean x weight, weight] of each micro-batch, summed over every process (TRL's average)
        sums = torch.zeros(len(batches), 2, dtype=torch.float64, device=pipeline.device)
        for i, row in enumerate(rows if policy is not None else ()):
            n = len(row.get("sequence_tokens", ()))
            if n and row["batch_weight"]:
                sums[i, 0] = (policy[i][:n] - reference[i][:n]).mean() * row["batch_weight"]
                sums[i, 1] = row["batch_weight"]
        sums = self.reduce(sums) if self.reduce is not None else sums
        kl = (sums[:, 0] / sums[:, 1].clamp(min=1)).clamp(min=0).tolist()
        return [{**b, "kl": k} for b, k in zip(batches, kl)]

    def _loss(self, head, hidden: torch.Tensor, target: torch.Tensor):
        logps = self._logps(head, hidden, target)
        if logps is None:
            return None, 0
        n = logps.numel()
        desirable = target[:n, self.WIDTH] > 0
        kl = target[0, self.WIDTH + 1] if self.cfg.loss_type == "kto" else None
        losses, rewards = kto_losses(self.cfg.loss_type, logps, target[:n, 2].to(logps.dtype), desirable, kl,
                                     beta=self.cfg.beta, desirable_weight=self.cfg.desirable_weight,
                                     undesirable_weight=self.cfg.undesirable_weight)
        with torch.no_grad():
            d, u = desirable.float(), (~desirable).float()
            stats = torch.stack([(rewards * d).sum(), (rewards * u).sum(), (logps.detach() * d).sum(),
                                 (logps.detach() * u).sum(), d.sum(), u.sum(),
                                 (kl if kl is not None else logps.new_zeros(())) * n]).float()
        return (losses.sum(), stats), n

    def eval_sums(self, head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out, n = self._loss(head, hidden, target)
        if out is None:
            return torch.zeros(self.eval_size, dtype=torch.float64, device=hidden.device)
        return eval_row(*out, n)  # [loss, statistics, examples]
