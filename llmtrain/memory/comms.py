"""What each GPU sends per optimizer step for the launch's strategy and mesh, and how long that takes beside the
step's compute (docs/scaling.md gives the formulas and a table).

Collectives are counted as NCCL's bandwidth-optimal ring algorithms run them. Over n ranks, a rank sends
  all-reduce of S bytes:       2 (n-1)/n S
  all-gather to S bytes:         (n-1)/n S     (each rank holds S/n and receives the rest)
  reduce-scatter of S bytes:     (n-1)/n S
A collective over every GPU of several nodes (DDP, FSDP across nodes) runs as rings whose channels NCCL spreads
over the GPUs' own network cards, so of what a GPU sends, 1/(GPUs per node) leaves the node over its card and the
rest goes over NVLink. HSDP's replica all-reduce runs between the GPUs of the same place on each node: all of it
crosses the network.

Per optimizer step of `grad_accum_steps` micro-batches:
- DDP: one all-reduce of the trainable gradients (the other micro-batches accumulate under no_sync).
- FSDP: every micro-batch all-gathers the parameters of each decoder layer and of the input embeddings for forward
  and again for backward (they are resharded after forward), and those of the tail (final norm and LM head, with the
  embeddings when they are tied) once: Accelerate's fsdp2_prepare_model keeps the tail gathered from the end of
  forward to the start of backward. All in the compute dtype; then a reduce-scatter of the trainable gradients, in
  fp32 (llmtrain's MixedPrecisionPolicy reduces in fp32), every micro-batch (train.fsdp_accumulate=sharded, the
  default: only shards are held between micro-batches) or once a step (unsharded).
- HSDP: FSDP's traffic within a node's shard group, plus one all-reduce of each GPU's gradient shard across the
  replicas (nodes) per step, with either setting (sharded accumulates the reduce-scattered shards until the last
  micro-batch). HSDP x TP: the same for one GPU's slice, with G / tp shards a node.
- FSDP x TP: every GPU holds its tensor-parallel slice of the model (params.tensor_parallel_shape), and FSDP's
  traffic is that of the slice over the world / tp GPUs holding the same slice (members of a ring on each node:
  GPUs per node / tp). Within each TP group (consecutive GPUs of a node): per micro-batch, an all-reduce of the
  activations (tokens x hidden, compute dtype) after attention's and the MLP's row-wise layer in forward, and one
  for each block's input gradient in backward (tensor.apply_tensor_parallel wraps a block's input once, so its
  column-wise layers' partial gradients meet before one all-reduce): 4 per layer, 5 with gradient checkpointing,
  whose recompute runs attention's again but stops before the MLP's (torch's non-reentrant checkpoint stops
  recomputing once the tensors backward needs are back, and the layer's output is not one of them; measured).
- Sequence parallelism (Ulysses, parallel.sequence_parallel N): within each sequence group of N consecutive GPUs,
  per micro-batch and decoder layer, the all-to-alls of q, k, v and the attention's output in forward (K/V repeated
  to N heads first where N is a multiple of the K/V heads), of their gradients in backward, and the forward's again
  in gradient checkpointing's recompute (o_proj and the MLP save tensors, so it runs the whole layer). Each GPU sends
  (N-1)/N of its local [T/N tokens x heads] tensors. A group within a node (N <= GPUs a node, as it is meant to be)
  sends all of it over NVLink; one that spans nodes sends (N - G)/N of its tensors to the GPUs of other nodes, over
  the network. The data-parallel strategy's collectives stay over every GPU.
- Pipeline parallelism (parallel.pipeline_parallel P, memory/pipeline.py): a stage's GPU runs its strategy's collectives
  over the stage's parameters within its group of world / P GPUs, and per micro-batch and virtual stage sends its output
  forward and its input's gradient backward (tokens x hidden each: PipelineTraffic), over the network where the
  neighbouring stage is on another node. Its step time adds the sends to the slot and stretches it by the bubble
  (Traffic.step_s).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.memory.params import ModelShape
from llmtrain.memory.spec import DTYPE_BYTES, TrainSpec
from llmtrain.memory.spec import QUANT_BYTES_PER_WEIGHT

NVLINK_GBPS = 3600.0  # H100 SXM, NVLink 4: 450 GB/s each way per GPU
INFINIBAND_GBPS = 400.0  # one NDR InfiniBand card per GPU (the usual 8-GPU H100 node)
H100_TFLOPS = 989.0  # dense bf16
H100_HBM_TBPS = 3.35  # H100 SXM's memory bandwidth, TB/s (H200: 4.8)
DEFAULT_MFU = 0.4


def all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


def all_gather(nbytes: float, n: int) -> float:
    return (n - 1) / n * nbytes


reduce_scatter = all_gather
all_to_all = all_gather  # each rank keeps 1/n of its S bytes and sends the rest


def link_seconds(nbytes: float, gbps: float) -> float:
    """Time to send `nbytes` at `gbps` gigabits per second."""
    return nbytes * 8 / (gbps * 1e9)


@dataclass(frozen=True)
class Network:
    intra_gbps: float = NVLINK_GBPS  # per GPU, within a node (gigabits per second)
    inter_gbps: float = INFINIBAND_GBPS  # per GPU, between nodes
    peak_tflops: float = H100_TFLOPS
    mfu: float = DEFAULT_MFU
    hbm_tbps: float = H100_HBM_TBPS  # one GPU's memory bandwidth: online RL's decode steps are bound by it


Parts = tuple[tuple[str, float, float], ...]  # (what, intra-node bytes, inter-node bytes) per GPU


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step, within its node and to other nodes, and the times they take."""

    parts: tuple[tuple[str, float, float], ...]  # (what, intra-node bytes, inter-node bytes) per GPU
    compute_s: float  # the step's model FLOPs at the stated MFU, plus sampling_s
    network: Network
    sampling_s: float = 0.0  # online RL: the step's sampling (sampling_seconds), part of compute_s
    forwards_s: float = 0.0  # the step's no-grad forwards (no_grad_seconds), part of compute_s
    forwards_what: str = ""  # whose (no_grad_forwards' words)
    sequence: SequenceTraffic | None = None  # sequence parallelism's all-to-alls (also among the parts)
    pipeline: PipelineTraffic | None = None  # a pipeline stage's boundary sends (the parts' last) and its bubble

    @property
    def intra_bytes(self) -> float:
        return sum(p[1] for p in self.parts)

    @property
    def inter_bytes(self) -> float:
        return sum(p[2] for p in self.parts)

    @property
    def intra_s(self) -> float:
        return link_seconds(self.intra_bytes, self.network.intra_gbps)

    @property
    def inter_s(self) -> float:
        return link_seconds(self.inter_bytes, self.network.inter_gbps)

    @property
    def network_s(self) -> float:
        return self.intra_s + self.inter_s

    @property
    def collectives_s(self) -> float:
        """The network time of the collectives, which overlap with the compute: all of it but a pipeline's sends."""
        return self.network_s - (self.pipeline.p2p_s(self.network) if self.pipeline else 0.0)

    @property
    def step_s(self) -> float:
        """The step's time by the model. Data-parallel: the compute or the collectives, whichever is longer (perfect
        overlap). A pipeline stage: M slots of its compute or collectives (overlapped) and then its boundary sends
        (torch's schedules wait for each batch of sends and receives before the next micro-batch), stretched by
        the bubble: (max(compute, collectives) + sends) / (1 - bubble), i.e. M + P - 1 slots (P - 1 idle)."""
        if self.pipeline is None:
            return max(self.compute_s, self.network_s)
        slot = max(self.compute_s, self.collectives_s) + self.pipeline.p2p_s(self.network)
        return slot / (1 - self.pipeline.bubble)

    @property
    def network_bound(self) -> bool:
        """The collectives take longer than the compute they could overlap with."""
        return self.network_s > self.compute_s

    def to_dict(self) -> dict:
        return {"intra_node_bytes": round(self.intra_bytes), "inter_node_bytes": round(self.inter_bytes),
                "intra_node_s": self.intra_s, "inter_node_s": self.inter_s, "compute_s": self.compute_s,
                "sampling_s": self.sampling_s, "no_grad_forwards_s": self.forwards_s,
                "network_bound": self.network_bound,
                "sequence_parallel": self.sequence.to_dict(self.network) if self.sequence else None,
                "pipeline": self.pipeline.to_dict(self.network) if self.pipeline else None, "step_s": self.step_s,
                "parts": [{"what": w, "intra_node_bytes": round(a), "inter_node_bytes": round(b)}
                          for w, a, b in self.parts],
                "assumed": {"intra_gbps": self.network.intra_gbps, "inter_gbps": self.network.inter_gbps,
                            "peak_tflops": self.network.peak_tflops, "mfu": self.network.mfu,
                            "hbm_tbps": self.network.hbm_tbps}}


@dataclass(frozen=True)
class SequenceTraffic:
    """Sequence parallelism's all-to-alls, per GPU per optimizer step: `payload` the local tensors they carry (q, k, v
    and the attention output and their gradients, every layer, every micro-batch, the recompute's too), of which a
    GPU sends (group-1)/group: `intra` bytes to GPUs of its node, `inter` to other nodes'."""

    group: int  # GPUs a sequence group
    gpus_per_node: int
    payload: float
    per_layer: float  # one layer's forward all-to-alls of one micro-batch (activations.all_to_all_bytes)
    passes: int  # all-to-all rounds a layer per micro-batch: forward, backward, and the recompute's forward
    intra: float
    inter: float

    @property
    def sent(self) -> float:
        return self.intra + self.inter

    @property
    def spans_nodes(self) -> bool:
        return self.group > self.gpus_per_node

    def times(self, network: Network) -> dict[str, float]:
        """seconds: on the links the model assumes (NVLink within the node, the network for what leaves it);
        nvlink_s and infiniband_s: all of it over NVLink (a group within a node), all of it over the network."""
        return {"seconds": link_seconds(self.intra, network.intra_gbps) + link_seconds(self.inter, network.inter_gbps),
                "nvlink_s": link_seconds(self.sent, network.intra_gbps),
                "infiniband_s": link_seconds(self.sent, network.inter_gbps)}

    def to_dict(self, network: Network) -> dict:
        return {"group": self.group, "spans_nodes": self.spans_nodes,
                "link": "nvlink and infiniband" if self.spans_nodes else "nvlink",
                "payload_bytes": round(self.payload), "per_layer_forward_bytes": round(self.per_layer),
                "passes_per_layer": self.passes, "sent_bytes": round(self.sent), "intra_node_bytes": round(self.intra),
                "inter_node_bytes": round(self.inter), **self.times(network)}


@dataclass(frozen=True)
class PipelineTraffic:
    """The pacing stage of a pipeline step (per GPU): its point-to-point sends, where they go, and the bubble."""

    stages: int
    chunks: int
    micro_batches: int
    rank: int  # the stage whose slot (compute and collectives, then its sends) is the longest
    send_bytes: float  # one boundary send: one micro-batch's tokens x hidden in the stream dtype
    p2p_intra: float  # bytes the stage sends a step to stages on its node
    p2p_inter: float  # ... and on other nodes
    bubble: float

    def p2p_s(self, network: Network) -> float:
        return link_seconds(self.p2p_intra, network.intra_gbps) + link_seconds(self.p2p_inter, network.inter_gbps)

    def to_dict(self, network: Network) -> dict:
        return {"stages": self.stages, "chunks": self.chunks, "micro_batches": self.micro_batches,
                "pacing_stage": self.rank, "bubble": self.bubble, "boundary_send_bytes": round(self.send_bytes),
                "p2p_intra_node_bytes": round(self.p2p_intra), "p2p_inter_node_bytes": round(self.p2p_inter),
                "p2p_s": self.p2p_s(network)}


def sequence_traffic(shape: ModelShape, spec: TrainSpec) -> SequenceTraffic | None:
    """The all-to-alls of spec's sequence groups per optimizer step (None without sequence parallelism): per
    micro-batch, every layer's forward, backward and (gradient checkpointing) recompute, each carrying
    activations.all_to_all_bytes of this GPU's tokens."""
    n = spec.sequence_parallel
    if n == 1:
        return None
    from llmtrain.memory import activations as act
    from llmtrain.memory.estimate import make_pass

    p = make_pass(shape, spec)
    layers = float(sum(act.all_to_all_bytes(p, shape.layer(i)) for i in range(shape.layers)))
    per_layer = layers / shape.layers  # (each layer's own where they differ: Gemma 4's heads)
    passes = 3 if spec.gradient_checkpointing else 2
    payload = spec.grad_accum_steps * passes * layers
    g = spec.num_gpus
    inter = (n - g) / n * payload if n > g else 0.0
    return SequenceTraffic(n, g, payload, per_layer, passes, all_to_all(payload, n) - inter, inter)


@dataclass(frozen=True)
class Gathered:
    """What FSDP all-gathers in one micro-batch, in the dtype it computes in: the units resharded after forward
    (decoder layers, untied input embeddings), gathered for forward and again for backward, and the tail (final norm,
    LM head, tied embeddings), gathered once."""

    resharded: float
    tail: float


def gathered_bytes(shape: ModelShape, spec: TrainSpec, *, trained_params: int) -> Gathered:
    """Every parameter in its compute dtype (bf16 under mixed precision), a 4-bit base as stored (4 bits and the
    quantisation constants a weight), and LoRA's trained parameters (counted with the layers they adapt)."""
    compute = spec.compute_bytes
    in_layers = shape.layer_params_total
    embed = 0 if shape.tied else shape.params_embed
    tail = shape.params_total - in_layers - embed
    if spec.method == "full":
        return Gathered(float((in_layers + embed) * compute), float(tail * compute))
    base = DTYPE_BYTES[spec.dtype] if spec.quantize else compute
    layers = float(in_layers * base)
    if spec.quantize:
        quantized = shape.layer_linear_params_total
        layers = quantized * QUANT_BYTES_PER_WEIGHT + (in_layers - quantized) * base
    return Gathered(layers + embed * base + trained_params * compute, float(tail * base))


@dataclass(frozen=True)
class Collective:
    """One kind of collective of an optimizer step: its payload summed over the step (all-gather: the gathered
    output; reduce-scatter: the input; all-reduce: the tensor), the group it runs in, and where that group is."""

    what: str
    kind: str  # all_gather | reduce_scatter | all_reduce
    nbytes: float
    group: int
    scope: str  # job: every GPU of every node; node: the GPUs of one node; across: one GPU per node

    def sent(self) -> float:
        return {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce": all_reduce}[self.kind](
            self.nbytes, self.group)


def collectives(spec: TrainSpec, *, trainable_bytes: float, gathered: Gathered, activations: float = 0.0,
                gathers: tuple[float, float] = (0.0, 0.0)) -> tuple[Collective, ...]:
    """The collectives of one optimizer step for spec's strategy over its GPUs and nodes. Under FSDP x TP the
    payloads are those of one GPU's slice, `activations` the bytes of one micro-batch's tokens x hidden summed
    over the decoder layers (tensor_parallel_activations), and `gathers` what a gathered plan (Phi's fused layers)
    all-gathers a micro-batch in forward and in backward (tensor_parallel_gathers)."""
    m, a = spec.num_nodes, spec.grad_accum_steps
    # the layers gathered in forward and again in backward; once with fsdp_reshard_after_forward: false
    per_step = a * ((2 if spec.reshard_after_forward else 1) * gathered.resharded + gathered.tail)
    scatters = a if spec.fsdp_accumulate == "sharded" else 1  # reduce-scatters of the gradients per step
    each = f" x {scatters} micro-batches" if scatters > 1 else ""
    if spec.strategy == "single" or spec.world == 1:
        return ()
    if spec.strategy == "ddp":
        return (Collective("all-reduce of the trainable gradients", "all_reduce", trainable_bytes, spec.world, "job"),)
    tp = ()
    if spec.tp > 1:
        per_layer = 5 if spec.gradient_checkpointing else 4
        tp = (Collective(f"all-reduce of the activations in the TP group, {per_layer} a layer x {a} micro-batches",
                         "all_reduce", a * per_layer * activations, spec.tp, "node"),)
        forward, backward = gathers  # a checkpointed layer's recompute gathers the fused outputs again
        if forward:
            tp += (Collective(f"all-gather of the fused layers' outputs and of their inputs' gradients in the TP "
                              f"group x {a} micro-batches", "all_gather",
                              a * ((2 if spec.gradient_checkpointing else 1) * forward + backward), spec.tp, "node"),)
    if spec.strategy == "fsdp":
        how = "forward and backward" if spec.reshard_after_forward else "once (kept from forward to backward)"
        return (Collective(f"all-gather of the parameters, {how} x {a} micro-batches", "all_gather",
                           per_step, spec.shards, "job"),
                Collective(f"reduce-scatter of the trainable gradients{each}", "reduce_scatter",
                           scatters * trainable_bytes, spec.shards, "job"), *tp)
    # hsdp: shard within a node, replicate across nodes (shards: the node's GPUs, or its TP groups)
    s = spec.shards
    how = "forward and backward" if spec.reshard_after_forward else "once (kept from forward to backward)"
    return (Collective(f"all-gather of the parameters within the node, {how} x {a} micro-batches",
                       "all_gather", per_step, s, "node"),
            Collective(f"reduce-scatter of the trainable gradients within the node{each}", "reduce_scatter",
                       scatters * trainable_bytes, s, "node"),
            Collective("all-reduce of the gradient shard across the replicas", "all_reduce", trainable_bytes / s, m,
                       "across"), *tp)


def data_parallel(spec: TrainSpec, *, trainable_bytes: float, gathered: Gathered, activations: float = 0.0,
                  gathers: tuple[float, float] = (0.0, 0.0)) -> Parts:
    """Per-GPU bytes sent in one optimizer step, within the node and across nodes. A collective over the whole job
    sends 1/(its GPUs per node) of a GPU's bytes over its network card when there are several nodes (under FSDP x TP
    an FSDP ring has GPUs per node / tp members on each node)."""
    return parts_of(spec, collectives(spec, trainable_bytes=trainable_bytes, gathered=gathered,
                                      activations=activations, gathers=gathers))


def parts_of(spec: TrainSpec, found) -> Parts:
    """The bytes each of `found`'s collectives sends, within the node and across (data_parallel's split)."""
    parts = []
    for c in found:
        sent = c.sent()
        per_node = spec.num_gpus // spec.tp
        across = {"job": sent / per_node if spec.num_nodes > 1 else 0.0, "node": 0.0, "across": sent}[c.scope]
        parts.append((c.what, sent - across, across))
    return tuple(parts)


def tensor_parallel_activations(shape: ModelShape, spec: TrainSpec) -> float:
    """What one micro-batch's activation all-reduces carry, summed over the layers: tokens x hidden in the compute
    dtype (FSDP's mixed precision runs the residual stream in it) per layer; 0 without tensor parallelism."""
    if spec.tp == 1:
        return 0.0
    return float(shape.layers * spec.tokens * shape.hidden * spec.compute_bytes)


def tensor_parallel_gathers(shape: ModelShape, spec: TrainSpec) -> tuple[float, float]:
    """What one micro-batch all-gathers in the TP group under a gathered plan (Phi's fused qkv_proj and gate_up_proj,
    shape.tp_gathers): in forward their outputs, in backward the gradients of o_proj's and down_proj's inputs, each
    tokens x the layer's elements in the compute dtype, summed over the layers; (0, 0) for every other plan."""
    if spec.tp == 1:
        return 0.0, 0.0
    unit = shape.layers * spec.tokens * spec.compute_bytes
    return float(unit * shape.tp_gathers[0]), float(unit * shape.tp_gathers[1])


def step_flops(shape: ModelShape, spec: TrainSpec, trainable_linear_share: float) -> float:
    """Model FLOPs of one GPU's optimizer step, as llmtrain's MFU counts them (metrics.flop_model): 6 per
    trained and 4 per frozen matrix parameter per token (of a mixture of experts, the top_k experts a token goes
    through), and attention's 6 L heads head_dim per l^2, with every
    example seq_len long (a token budget: as many full-length examples as fit). Under sequence parallelism a GPU
    does 1/N of its group's: the layers on its 1/N of the tokens, attention for 1/N of the heads over all of them."""
    tokens = spec.tokens * spec.grad_accum_steps
    body = shape.active_params_total * (4 + 2 * trainable_linear_share)
    head = shape.head_outputs * shape.hidden * (6 if spec.method == "full" else 4)
    attn = 6.0 * shape.attention_width_total * tokens * min(spec.seq_len, spec.tokens)
    return (tokens * (body + head) + attn) / spec.sequence_parallel


def forward_flops(shape: ModelShape, spec: TrainSpec) -> float:
    """Model FLOPs of one no-grad forward of a model of `shape` over one GPU's sequences of an optimizer step: 2 per
    matrix parameter (the head's among them) per token, and attention's 2 L heads head_dim per l^2, a third of
    step_flops' frozen terms; under sequence parallelism a GPU's 1/N."""
    tokens = spec.tokens * spec.grad_accum_steps
    attn = 2.0 * shape.attention_width_total * tokens * min(spec.seq_len, spec.tokens)
    matrices = shape.active_params_total + shape.head_outputs * shape.hidden
    return (2.0 * tokens * matrices + attn) / spec.sequence_parallel


def recompute_flops(shape: ModelShape, spec: TrainSpec) -> float:
    """FLOPs a training step runs beyond step_flops' (which MFU counts): the loss chunks' LM head again in backward
    (loss.compute_loss checkpoints each chunk), and with gradient checkpointing the decoder layers' forward again:
    a whole forward (forward_flops)."""
    if spec.gradient_checkpointing:
        return forward_flops(shape, spec)
    return 2.0 * spec.tokens * spec.grad_accum_steps * shape.head_outputs * shape.hidden / spec.sequence_parallel


def no_grad_rate(network: Network, step: float, recompute: float) -> float:
    """FLOPs a second of a no-grad forward beside a step of `step` model FLOPs that recomputes `recompute` more. MFU
    counts the step's model FLOPs (step_flops), not what it recomputes, so at the stated MFU the device runs
    (step + recompute) / step times that many FLOPs a second; a forward outside the step's runs at that rate."""
    return network.peak_tflops * 1e12 * network.mfu * (step + recompute) / step


def no_grad_seconds(shape: ModelShape, spec: TrainSpec, network: Network, trainable_linear_share: float) -> float:
    """The step's no-grad forwards (no_grad_flops) in seconds, at no_grad_rate."""
    flops = no_grad_flops(shape, spec)
    if not flops:
        return 0.0
    return flops / no_grad_rate(network, step_flops(shape, spec, trainable_linear_share), recompute_flops(shape, spec))


def no_grad_flops(shape: ModelShape, spec: TrainSpec) -> float:
    """Model FLOPs of the step's no-grad forwards beside its forward and backward, which MFU does not count and the
    step still runs: spec.extra_forwards passes of the trained model's shape (a reference, KTO's KL sequences, online
    RL's log-probabilities a round: spec.extra_forwards_of), a distillation teacher's forward over every sequence, and
    each learned reward model's over the completions once a round (1 / num_iterations a step)."""
    flops = spec.extra_forwards * forward_flops(shape, spec)
    if spec.teacher is not None:
        flops += forward_flops(spec.teacher, spec)
    for model in spec.reward_models:
        if model.shape is not None:
            flops += forward_flops(model.shape, spec) / spec.num_iterations
    return flops


def no_grad_forwards(spec: TrainSpec) -> str:
    """no_grad_flops' passes in words: '' where there are none."""
    said = [spec.extra_forwards_what] if spec.extra_forwards else []
    if spec.teacher is not None:
        said.append("the teacher's over every sequence")
    if any(m.shape is not None for m in spec.reward_models):
        said.append("the reward models' once a round")
    return "; ".join(said)


def sampling_seconds(shape: ModelShape, spec: TrainSpec, *, weight_bytes: float, network: Network) -> float:
    """Online RL's sampling per optimizer step (0 without): grad_accum_steps micro-batches, each the prefill of the
    micro-batch's prompts (their model FLOPs, 2 per parameter per token, at the stated MFU) and
    rl.max_completion_tokens decode steps. A decode step of a few dozen rows is bound by memory, not FLOPs: it reads
    every weight once (the adapters unmerged beside them; under FSDP the whole gathered model, not the GPU's shard)
    and the static KV cache (estimate.kv_cache_bytes, whole: the step has a fixed shape), so it takes those bytes over
    the GPU's memory bandwidth. With rl.num_iterations N a step samples once in N: 1 / N of that a step. With
    rl.generation_batch=step the step's micro-batches are one call: the weights read once a decode step for all of
    them, beside their KV caches."""
    if not spec.num_generations:
        return 0.0
    from llmtrain.memory.estimate import kv_cache_bytes

    prompts = max(1, spec.micro_batch // spec.num_generations) * spec.sampled_batches
    if spec.sharded:  # FSDP: the rollout gathered the whole model (gathered_for_generation), in the compute dtype
        weight_bytes = shape.params_total * spec.compute_bytes
    params = shape.active_params_total + shape.vocab * shape.hidden
    prefill = 2.0 * params * prompts * spec.prompt_tokens / (network.peak_tflops * 1e12 * network.mfu)
    decode = spec.max_completion_tokens * (weight_bytes + kv_cache_bytes(shape, spec)) / (network.hbm_tbps * 1e12)
    return spec.grad_accum_steps / spec.sampled_batches * (prefill + decode) / spec.num_iterations


def traffic(shape: ModelShape, spec: TrainSpec, *, trained_params: int, trainable_bytes: float,
            network: Network = Network(), weight_bytes: float = 0.0) -> Traffic:
    """One GPU's traffic and compute time per optimizer step; trainable_bytes are the gradients as they are
    reduced (the trained parameters in their master dtype); weight_bytes, the weights a GPU holds (online RL's
    decode steps read them all). Under sequence parallelism the data-parallel collectives are the strategy's over every
    GPU (DDP or FSDP averages the gradients over all processes) and the all-to-alls are sequence_traffic's."""
    gathered = gathered_bytes(shape, spec, trained_params=trained_params)
    share = 1.0 if spec.method == "full" else 0.0
    sampling = sampling_seconds(shape, spec, weight_bytes=weight_bytes, network=network)
    forwards = no_grad_seconds(shape, spec, network, share)
    compute = step_flops(shape, spec, share) / (network.peak_tflops * 1e12 * network.mfu) + forwards + sampling
    parts = data_parallel(spec, trainable_bytes=trainable_bytes, gathered=gathered,
                          activations=tensor_parallel_activations(shape, spec),
                          gathers=tensor_parallel_gathers(shape, spec))
    sequence = sequence_traffic(shape, spec)
    if sequence is not None:
        within = "spanning nodes" if sequence.spans_nodes else "within the node"
        what = (f"all-to-all of q, k, v and the attention output in the sequence group of {sequence.group} ({within}), "
                f"{sequence.passes} a layer x {spec.grad_accum_steps} micro-batches")
        parts += ((what, sequence.intra, sequence.inter),)
    return Traffic(parts, compute, network, sampling, forwards, no_grad_forwards(spec), sequence)


def step_traffic(shape: ModelShape, spec: TrainSpec, network: Network = Network()) -> Traffic:
    """traffic() for the run spec describes: its trained parameters and the bytes of their gradients (under FSDP x TP,
    of one GPU's tensor-parallel slice, whose work is also the step's compute on that GPU)."""
    from llmtrain.memory.params import run_lora_plan, tensor_parallel_shape
    from llmtrain.memory.states import states

    shape = tensor_parallel_shape(shape, spec.tp)
    plan = run_lora_plan(shape, spec)
    whole = spec.but(cpu_offload=False)
    held = states(shape, whole, plan)
    gradients = held.grads * whole.shards  # one GPU's shard times the shards
    trained = shape.params_total if plan is None else plan.trainable(shape)
    return traffic(shape, spec, trained_params=trained, trainable_bytes=gradients, network=network,
                   weight_bytes=held.weights)
