"""Sequence parallelism, the Ulysses design (DeepSpeed Ulysses, ALST), on torch.distributed collectives: the groups
and the checks. Each process's slice of a row: objectives/sequence.py; the attention: model/ulysses.py.

`parallel.sequence_parallel: N` groups N consecutive processes. A group reads one micro-batch (one packed row of the
token budget) and each of its processes keeps 1/N of the row's tokens (objectives/sequence.shard_batch): embeddings, norms, MLPs, the
loss and their activations run on that slice alone. Around attention (model/ulysses.py), an all-to-all turns the
slices of every head into every token of 1/N of the heads; the run's own varlen attention then runs on the whole
packed row with its real example boundaries, sliding window included, and a second all-to-all turns the output back
into slices. So packing and sliding windows are exact, with no ring and no load balancing. K/V heads fewer than N are
replicated (each K/V head N / Hkv times, so every process gets the K/V head of its query heads); other splits are
refused (`check`).

Gradients: each process backpropagates its slice's summed loss. DDP and FSDP average gradients over every process;
the step multiplies the loss by the processes (not the data ranks) over the window's trained tokens, so the result is
the gradient of the group's summed loss, as one process computes it on the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.errors import LLMTrainError


@dataclass(frozen=True)
class SequenceGroup:
    size: int = 1  # processes that share one sequence
    rank: int = 0  # this process's place in its group: which slice of the row it keeps
    group: object = None  # the torch.distributed process group of this process's sequence group


_GROUP = SequenceGroup()  # set by setup() when the Accelerator is built; one per process, as torch.distributed's own


def sequence_group() -> SequenceGroup:
    """This process's sequence group (size 1: sequence parallelism is off)."""
    return _GROUP


def sequence_parallel_size() -> int:
    return _GROUP.size


def setup(size: int) -> None:
    """Form the sequence groups (consecutive ranks) once the process group exists; size 1 forgets any earlier one
    (a second train() in one process)."""
    global _GROUP
    if size == 1:
        _GROUP = SequenceGroup()
        return
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):  # every process creates every group, in the same order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    _GROUP = SequenceGroup(size=size, rank=rank % size, group=mine)


def check(recipe, *, world: int, mesh=None, heads: int | None = None, kv_heads: int | None = None) -> None:
    """Refuse what sequence parallelism does not train, before the model loads (the head counts once known).
    `mesh`: the launch's parallelism_config, if any."""
    n = recipe.parallel.sequence_parallel
    if n == 1:
        return
    key = f"parallel.sequence_parallel={n}"
    if mesh is not None:
        raise LLMTrainError(f"{key} runs on a plain DDP or FSDP launch (accelerate_configs/ddp.yaml, fsdp.yaml); "
                            "this launch has a parallelism_config mesh (HSDP or tensor parallelism), which sequence "
                            "parallelism is not built to compose with yet. Drop the parallelism_config section, or "
                            "set parallel.sequence_parallel=1")
    if world % n:
        raise LLMTrainError(f"{key} splits each sequence over {n} processes, but the launch has {world}: launch a "
                            f"multiple of {n} processes (--num_processes), or set parallel.sequence_parallel to a "
                            f"divisor of {world}")
    rm = recipe.reward_model is not None
    if recipe.rl is not None or recipe.preference is not None or recipe.kto is not None or rm:
        mode = ("online RL (rl:)" if recipe.rl is not None else "preference pairs (preference:)"
                if recipe.preference is not None else "a reward model (reward_model:)" if rm else "KTO (kto:)")
        raise LLMTrainError(
            f"{key} trains supervised fine-tuning only; {mode} is refused: "
            + ("its rollout samples whole completions on every process, which a sequence group would have to "
               "sample together" if recipe.rl is not None else
               "its score head reads each sequence's last token, which one process of the group holds" if rm else
               "its loss needs each sequence's whole log-probability, which the sequence group would have to sum "
               "first")
            + ". Set parallel.sequence_parallel=1, or train the long sequences with model.gradient_checkpointing, "
              "model.activation_offload and model.tiled_mlp on each GPU (docs/long-context.md)")
    if recipe.model.attn_implementation not in ("auto", "varlen"):
        raise LLMTrainError(f"{key} runs llmtrain's varlen attention on the gathered sequence; "
                            f"model.attn_implementation={recipe.model.attn_implementation} is refused. Set it to "
                            "auto")
    if recipe.model.compile:
        raise LLMTrainError(f"{key} with model.compile is untested; set model.compile=false")
    if heads is not None:
        if heads % n:
            raise LLMTrainError(f"{key}: the model's {heads} attention heads do not split into {n} equal groups; "
                                f"set parallel.sequence_parallel to a divisor of {heads}")
        if kv_heads % n and n % kv_heads:
            raise LLMTrainError(f"{key}: the model's {kv_heads} key/value heads neither split into {n} groups nor "
                                f"divide {n} (to be replicated); set parallel.sequence_parallel to a divisor or a "
                                f"multiple of {kv_heads} that divides {heads}")


def describe(size: int, world: int) -> str:
    """The start-up line's words for the layout."""
    return (f"sequence parallelism: each sequence split over {size} processes (Ulysses all-to-all around attention), "
            f"{world // size} data-parallel group{'s' if world // size > 1 else ''}")
