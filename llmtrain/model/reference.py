"""A full fine-tune's reference model: a frozen copy of the starting weights, and the mix that makes it follow the
policy (TR-DPO, Gorbatovski et al. 2024: TRL's sync_ref_model).

Which runs hold one is the capability table's (capabilities.reference_copy: KTO, preference.reference copy and
online RL with rl.beta > 0, each a full fine-tune; a LoRA run's reference is its own model with the adapter disabled,
no copy).
One process and DDP copy the policy before it trains (`frozen_copy`); under FSDP the loop reads the starting weights
again and shards them as the policy is (loop/phases.build_reference); on pipeline stages each process copies its own
stages' weights and exchanges them into the stages for the reference's passes (`StageCopy`). `Reference` holds the
copy and, with the mode's sync_reference, mixes the policy into it after every every_steps-th optimizer step, exactly
as TRL's SyncRefModelCallback does (`mix`); a checkpoint then carries the reference (torch.distributed.checkpoint,
whole or sharded as it is held), and a resume reads it back, so the run goes on with the reference it had. A LoRA run's
reference is its own model with the adapter disabled; with sync_reference (alpha 1 only) it becomes the adapter as
it was at the last sync (`AdapterReference`), which TRL does not offer (it refuses sync_ref_model with PEFT).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch

from llmtrain.errors import LLMTrainError
from llmtrain.model.split import local

FOLDER = "reference"  # in a checkpoint: the reference's weights, once a sync has moved them


def frozen_copy(model, *, whose: str):
    """A copy of the (unwrapped) model's starting weights, in eval mode (no dropout, as TRL's disable_dropout), that
    nothing trains. Refused where the model is sharded (tensor parallelism: capabilities refuses it first): a whole
    copy on every process is what sharding is there to avoid."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise LLMTrainError(
            f"{whose}: a full fine-tune (no lora: section) keeps a frozen copy of the starting model as its reference, "
            "whole on every process, and this launch shards the model, which a whole copy would undo. Add a lora: "
            "section (the reference is then the model with its adapter disabled, no copy), or launch one process, "
            "DDP (accelerate_configs/ddp.yaml) or FSDP")
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def forward_of(model, reference):
    """The reference model and the context its forward runs in: a full fine-tune's frozen copy (a Reference), LoRA's
    adapter as it was at the last sync (an AdapterReference), or (None) the model itself with its adapter
    disabled."""
    if reference is None:
        return model, adapter_off(model)  # the base model: the reference, with no copy of it
    return reference.forward(model)


@contextmanager
def adapter_off(model):
    """peft's disable_adapter (a peft model's LoRA off), with every parameter's requires_grad put back after it.
    peft freezes modules_to_save's copies (a trained head or embeddings) and unfreezes the originals by setting
    requires_grad on the tensors the modules hold when the block starts, and the reverse on those they hold when it
    ends. Under FSDP2 those can differ: a unit gathered by the block's forward (the root, which FSDP keeps gathered
    after a forward) holds its gathered tensors at the end, so its shards stayed frozen, and FSDP gives each later
    gathering its shards' requires_grad: the head's copy trained no more once a forward ran without the block
    (LoRA's moving reference after its first sync; tests/test_reference_sync.py)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with model.disable_adapter():
            yield
    finally:
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


@torch.no_grad()
def mix(reference, policy, alpha: float) -> None:
    """TRL's SyncRefModelCallback._sync_target_model: every reference weight becomes alpha x the policy's +
    (1 - alpha) x its own (mul_ then add_, TRL's order of operations). Matched by name (`_counterparts`)."""
    for part, source in _counterparts(reference, policy):
        _mix_into(part, source, alpha)


@torch.no_grad()
def copy_into(reference, policy) -> None:
    """Every reference weight (and buffer) the policy's as it is now, cast to the reference's dtype, matched by name
    (`_counterparts`): FSDP's reference, built empty and sharded like the policy (loop/phases.build_reference),
    takes the policy's starting weights so, with no second read of them and none whole on a process."""
    for part, source in _counterparts(reference, policy):
        part.copy_(source)
    buffers = dict(policy.named_buffers())  # a checkpoint's persistent buffers (never sharded), by name as well
    for name, b in reference.named_buffers():
        if name in buffers:
            b.copy_(buffers[name])


def _counterparts(reference, policy):
    """(this process's part of a reference weight, the policy's weight laid out as it) for each reference weight,
    matched by name, so a reference whose head FSDP untied (parallel/fsdp.shard_frozen) takes the policy's tied
    weight in both. A sharded weight pairs its shard where the two are sharded alike (on the same mesh), else the
    policy's weight gathered, and cut as the reference's is where it is sharded over another mesh (FSDP x TP's
    reference over every process of the mesh: parallel/fsdp._frozen_mesh); every process takes part, one weight at
    a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ours = dict(policy.named_parameters(remove_duplicate=False))
    for name, target in reference.named_parameters():
        source = ours.get(name)
        if source is None:
            raise LLMTrainError(f"the reference's weight {name} has no counterpart in the policy (was the model "
                                "changed after the reference was made?)")
        if isinstance(source, DTensor):
            if isinstance(target, DTensor) and source.device_mesh == target.device_mesh:
                source = source.redistribute(target.device_mesh, target.placements)
            elif isinstance(target, DTensor):
                source = distribute_tensor(source.full_tensor(), target.device_mesh, target.placements,
                                           src_data_rank=None)  # each process cuts its own part: no communication
            else:
                source = source.full_tensor()
        part = local(target)
        yield part.data, local(source).data.to(part.device)


def _mix_into(target: torch.Tensor, source: torch.Tensor, alpha: float) -> None:
    """target = alpha x source + (1 - alpha) x target, in place: mul_ then add_, TRL's order of operations."""
    target.mul_(1.0 - alpha).add_(source, alpha=alpha)


class Reference:
    """A full fine-tune's reference (`module`: the frozen copy) and its sync (`every`, `alpha`; every=None: it stays
    the starting weights)."""

    def __init__(self, module, sync=None):
        self.module = module
        self.every = sync.every_steps if sync is not None else None
        self.alpha = sync.alpha if sync is not None else None
        self.moved = False  # a sync has run (this process, or the run before a resume): checkpoints carry it

    def forward(self, model):
        return self.module, nullcontext()

    def after_step(self, policy, step: int) -> bool:
        """After optimizer step `step` (1-based, as TRL's global_step): the mix, where it is due. True if it ran."""
        if self.every is None or step % self.every:
            return False
        mix(self.module, policy, self.alpha)
        self.moved = True
        return True

    def state(self) -> dict:
        return self.module.state_dict()

    def write(self, folder: Path) -> None:
        """Into a checkpoint being written (every process calls it): the reference's weights, once a sync has moved
        them from the starting ones."""
        if self.moved:
            _save(self.state(), folder / FOLDER)

    def restore(self, checkpoint: Path | None) -> bool:
        """From the checkpoint a resume starts at: its reference, if it holds one (else the starting weights are
        the reference still). True if it did."""
        if checkpoint is None or not (checkpoint / FOLDER).is_dir():
            return False
        _load(self.state(), checkpoint / FOLDER)  # in place: the state's tensors are the weights
        self.moved = True
        return True


class AdapterReference(Reference):
    """LoRA's reference under sync_reference, which can only be the policy whole (alpha 1, the paper's hard update:
    a mix of two adapters, B1 A1 and B2 A2, is no adapter of the same rank). Until the first sync the base model, the
    adapter disabled, as without it; after one, the model with the trained weights (the adapters, DoRA's magnitudes,
    modules_to_save's copies) as they were then: a snapshot, copied into the weights for the reference's no-grad
    forward (in eval mode: no LoRA dropout) and copied back after it. The snapshot and the spare that holds the
    trained weights meanwhile cost them twice more; the swap, three copies of them a forward (each objective runs
    the reference before the policy's forward, so no graph holds the weights it changes).
    Under FSDP (and FSDP x TP) each process swaps its shards and slices (every process runs the reference's forward,
    which gathers them), and every unit is resharded before the forward and after it, so that none (the root, which
    FSDP keeps gathered after a forward: an eval's policy forward runs before the reference's) carries the policy's
    weights into the reference's forward or the snapshot's into the policy's; the checkpoint's snapshot is sharded as
    the weights are. Inside RLOO's rollout (`held`, where `whole`) FSDP holds the policy gathered (sampling) and a
    process runs as many reference passes as its completions fill, with no collective: the swap then writes the
    snapshot's whole weights (all-gathered when it is taken, once a sync, so `whole` costs the trained weights twice
    more, whole) into the gathered ones, and resharding nothing. GRPO runs it in each update's passes
    (grpo._reference_once); FSDP x TP's gathered weights are split by TP, which the table refuses there. Pipeline
    stages (`stages`: this process's stage modules, an FSDP launch's root units) hold nothing gathered through the
    rollout (each pass through the schedule gathers the units it runs): the swap there is the shards' whole way,
    every unit of the stages resharded first (a stage's root holds a trained head copy)."""

    def __init__(self, model, sync, *, whole: bool = False, stages=()):
        super().__init__(None, sync)
        self.model = model  # the unwrapped peft model
        self.stages = tuple(stages)
        # the trained weights (found once: a checkpoint loads into them in place), their names for the checkpoint
        self.names, self.trained = zip(*[(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad])
        self.local = [local(t) for t in self.trained]  # what the swap copies: a sharded weight's own shard
        self.snapshot: list[torch.Tensor] | None = None  # in `names`' order, sharded as the weights (the checkpoint)
        self.snapshot_local: list[torch.Tensor] | None = None
        self.spare: list[torch.Tensor] | None = None
        # `whole`: the snapshot whole too, for a swap into weights FSDP holds gathered (RLOO's rollout)
        self.whole, self.snapshot_whole, self.spare_whole, self.gathered = whole, None, None, False

    def forward(self, model):
        if self.snapshot is None:
            return forward_of(model, None)
        return model, self._swapped_gathered() if self.gathered else self._swapped()

    @contextmanager
    def held(self):
        """A block in which the model's units are held gathered (RLOO's rollout, rollouts.held_whole): the swap
        writes into the gathered weights the modules hold (not on stages, whose rollout holds none gathered)."""
        if self.stages:
            yield
            return
        self.gathered = True
        try:
            yield
        finally:
            self.gathered = False

    @contextmanager
    def _swapped(self):
        local = self.local
        if self.spare is None:
            self.spare = [t.clone() for t in local]

        def put_in():
            torch._foreach_copy_(self.spare, local)
            torch._foreach_copy_(local, self.snapshot_local)

        with _holding(self.model, self.stages, put_in, lambda: torch._foreach_copy_(local, self.spare)):
            yield

    @contextmanager
    def _swapped_gathered(self):
        """The swap inside a block whose units FSDP holds gathered: each trained weight's gathered tensor (the one
        its module holds now) takes the snapshot's whole value (under FSDP x TP, where the gathered weight is this
        process's TP slice, a DTensor of the TP mesh: that slice of it, cut without communication), a weight no unit
        gathers (one process, DDP) its own; no collective, and no reshard."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        held = dict(self.model.named_parameters())
        into, source = [], []
        for i, name in enumerate(self.names):
            now = held[name]
            trained = self.trained[i]
            if isinstance(trained, DTensor) and (not isinstance(now, DTensor) or
                                                 now.device_mesh != trained.device_mesh):  # gathered
                if self.snapshot_whole is None:
                    raise RuntimeError("LoRA's moving reference: a gathered weight, and no whole snapshot to swap in")
                whole = self.snapshot_whole[i]
                if isinstance(now, DTensor):  # FSDP x TP: gathered over the shards, still split over the TP ranks
                    whole = distribute_tensor(whole, now.device_mesh, now.placements, src_data_rank=None).to_local()
                into.append(local(now.detach()))
                source.append(whole)
            else:
                into.append(local(now.detach()))
                source.append(self.snapshot_local[i])
        if self.spare_whole is None or [t.shape for t in self.spare_whole] != [t.shape for t in into]:
            self.spare_whole = [t.clone() for t in into]
        training = self.model.training
        with torch.no_grad():
            torch._foreach_copy_(self.spare_whole, into)
            torch._foreach_copy_(into, source)
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)
            with torch.no_grad():
                torch._foreach_copy_(into, self.spare_whole)

    def _take_snapshot(self) -> None:
        self.snapshot = [t.clone() for t in self.trained]
        self.snapshot_local = [local(t) for t in self.snapshot]

    def _gather_snapshot(self) -> None:
        """`whole`: the snapshot's whole weights (every process calls it: a sharded one is all-gathered)."""
        if self.whole:
            self.snapshot_whole = [_whole(t) for t in self.snapshot]

    def after_step(self, policy, step: int) -> bool:
        if step % self.every:
            return False
        with torch.no_grad():
            if self.snapshot is None:
                self._take_snapshot()
            else:
                torch._foreach_copy_(self.snapshot_local, self.local)
            self._gather_snapshot()
        self.moved = True
        return True

    def restore(self, checkpoint: Path | None) -> bool:
        restored = super().restore(checkpoint)
        if restored:
            with torch.no_grad():
                self._gather_snapshot()
        return restored

    def state(self) -> dict:
        if self.snapshot is None:  # a resume: read into a copy of the weights' shapes (and shards)
            self._take_snapshot()
        return dict(zip(self.names, self.snapshot))


class StageCopy(Reference):
    """A full fine-tune's reference on pipeline stages: each process's copy of its own stages' starting weights
    (its layers, and the embeddings or the head where it holds them; sharded as the weights are under an FSDP launch),
    which no stage of its own runs. The reference passes run through the policy's stages, the copy exchanged into
    their weights for the pass and back after it (`forward`): a copy with stages of its own would need the schedule
    twice over. The exchange goes one weight at a time through a temporary (the largest weight once more, briefly), so
    the copy costs the stage's weights once, as one process's frozen copy costs the model's. sync_reference mixes the
    policy into it as `mix` does (TRL's order of operations, each process its own part); a checkpoint carries it by
    the weights' names, each stage's own."""

    def __init__(self, model, sync, *, stages=()):
        super().__init__(None, sync)
        self.model = model  # the unwrapped model, which holds this process's stages' weights (the rest: Elsewhere)
        self.stages = tuple(stages)  # the stage modules (an FSDP launch's root units: the embeddings, the head)
        self.names, weights = zip(*[(n, p.detach()) for n, p in model.named_parameters()])
        self.local = [local(t) for t in weights]  # the weights' own storage (a shard under FSDP)
        with torch.no_grad():
            self.copy = [t.clone() for t in weights]  # sharded as the weights (the checkpoint's)
        self.copy_local = [local(t) for t in self.copy]

    def forward(self, model):
        return model, self._exchanged()

    def _exchanged(self):
        exchange = partial(_exchange, self.local, self.copy_local)
        return _holding(self.model, self.stages, exchange, exchange)

    @torch.no_grad()
    def after_step(self, policy, step: int) -> bool:
        if self.every is None or step % self.every:
            return False
        for target, source in zip(self.copy_local, self.local):  # as mix does it, tensor by tensor
            _mix_into(target, source, self.alpha)
        self.moved = True
        return True

    def state(self) -> dict:
        return dict(zip(self.names, self.copy))


@contextmanager
def _holding(model, stages, put_in, put_back):
    """The model in eval mode (no dropout) with the reference's weights: `put_in` writes them into the weights (each
    process its own shards), `put_back` the policy's after the block, both without gradient. Every FSDP unit of the
    model and of its pipeline `stages` is resharded before and after: a unit FSDP holds gathered (the root after an
    eval forward of the policy; a stage, which FSDP keeps unsharded between its forward and backward) would run the
    policy's weights whatever its shards hold, or carry the reference's into the policy's next forward."""
    training = model.training
    _resharded(model, *stages)
    with torch.no_grad():
        put_in()
    model.eval()
    try:
        yield
    finally:
        model.train(training)
        _resharded(model, *stages)
        with torch.no_grad():
            put_back()


@torch.no_grad()
def _exchange(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Each a[i]'s values and b[i]'s exchanged in place, one pair at a time (a temporary the size of one)."""
    for x, y in zip(a, b):
        held = x.clone()
        x.copy_(y)
        y.copy_(held)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A weight's whole value: a DTensor's all-gathered (a collective), else a copy."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.clone()




def _resharded(*models) -> None:
    """Every FSDP unit of `models` resharded (its gathered weights freed; the next forward gathers the shards again).
    Nothing to do without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def _save(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder))


def _load(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder))


def saved_problem(checkpoint: Path, *, every: int | None) -> str | None:
    """Why this run cannot resume `checkpoint` with the reference it needs (None: it can). Read before anything is
    written: a checkpoint past the first sync that holds no reference was written without sync_reference."""
    import json

    if every is None or (checkpoint / FOLDER).is_dir():
        return None
    step = int(json.loads((checkpoint / "train_state.json").read_text())["step"])
    if step < every:
        return None
    return (f"checkpoint {checkpoint} is at step {step}, past the first sync of the reference (sync_reference."
            f"every_steps={every}), and holds no reference ({FOLDER}/): it was written without sync_reference, so its "
            "reference is the starting weights. Resume it with the recipe that wrote it (its recipe.yaml), or start a "
            "new run with sync_reference.")
