"""Sequence parallelism (parallel.sequence_parallel), in one room: the Ulysses design (DeepSpeed Ulysses, ALST) on
torch.distributed collectives.

- group.py: this process's sequence group (consecutive ranks) and the start-up line's words;
- shards.py: each process's slice of the group's packed row (`shard_batch`), the objective that collates it
  (`SequenceShards`; online RL's and distillation's rollout: each process samples a share, `shared_sampling`, the
  first scores, `on_first_of_group`, then the rows are split),
  and the sums over the group: the eval's per-example ones, each sequence's log-probability or score for a loss of
  whole sequences (`sequence_sum`), the load-balancing loss's (`balance_sums`);
- attention.py: the all-to-all around llmtrain's varlen attention, registered with transformers as the model's
  attention (`attach`).

`parallel.sequence_parallel: N` groups N consecutive processes. A group reads one micro-batch (one packed row of the
token budget) and each of its processes keeps 1/N of the row's tokens (shards.py): embeddings, norms, MLPs, the loss and
their activations run on that slice alone. Around attention (attention.py), an all-to-all turns the slices of every head
into every token of 1/N of the heads; the run's own varlen attention then runs on the whole packed row with its real
example boundaries, sliding window included, and a second all-to-all turns the output back into slices. So packing and
sliding windows are exact, with no ring and no load balancing. K/V heads fewer than N are replicated (each K/V head N /
Hkv times, so every process gets the K/V head of its query heads); other splits are refused with the rest of the layout
(capabilities.model_problems).

Gradients: each process backpropagates its slice's summed loss (a loss of whole sequences: the group's loss, computed
from the summed log-probabilities on every process, through its own slice; shards.SequenceShards). DDP and FSDP
average gradients over every process; the step multiplies the loss by the processes (not the data ranks) over the
window's trained tokens, so the result is the gradient of the group's summed loss, as one process computes it on the
whole row.

May import: the schema, data/ and model/ (the batching's counts, the varlen attention), this folder,
and parallel/collectives.py.
"""
