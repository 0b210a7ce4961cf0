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

Per optimizer step of `grad_accum` micro-batches:
- DDP: one all-reduce of the trainable gradients (the other micro-batches accumulate under no_sync).
- FSDP: every micro-batch all-gathers the parameters for forward and again for backward (they are resharded after
  forward), in the compute dtype; one reduce-scatter of the trainable gradients per step, in fp32 (llmtrain's
  MixedPrecisionPolicy reduces in fp32).
- HSDP: FSDP's traffic within a node's shard group, plus one all-reduce of each GPU's gradient shard across the
  replicas (nodes).
- Tensor parallelism (not trained by llmtrain; for comparison): 2 all-reduces of the activations per layer in
  forward and 2 in backward, per micro-batch, among the tp GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.memory.params import ModelShape
from llmtrain.memory.estimate import QUANT_BYTES_PER_WEIGHT
from llmtrain.memory.spec import DTYPE_BYTES, PRECISION_DTYPE, TrainSpec

NVLINK_GBPS = 3600.0  # H100 SXM, NVLink 4: 450 GB/s each way per GPU
INFINIBAND_GBPS = 400.0  # one NDR InfiniBand card per GPU (the usual 8-GPU H100 node)
H100_TFLOPS = 989.0  # dense bf16
DEFAULT_MFU = 0.4


def all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


def all_gather(nbytes: float, n: int) -> float:
    return (n - 1) / n * nbytes


reduce_scatter = all_gather


@dataclass(frozen=True)
class Network:
    intra_gbps: float = NVLINK_GBPS  # per GPU, within a node (gigabits per second)
    inter_gbps: float = INFINIBAND_GBPS  # per GPU, between nodes
    peak_tflops: float = H100_TFLOPS
    mfu: float = DEFAULT_MFU


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step, within its node and to other nodes, and the times they take."""

    parts: tuple[tuple[str, float, float], ...]  # (what, intra-node bytes, inter-node bytes)
    compute_s: float  # the step's model FLOPs at the stated MFU
    network: Network

    @property
    def intra_bytes(self) -> float:
        return sum(p[1] for p in self.parts)

    @property
    def inter_bytes(self) -> float:
        return sum(p[2] for p in self.parts)

    @property
    def intra_s(self) -> float:
        return self.intra_bytes * 8 / (self.network.intra_gbps * 1e9)

    @property
    def inter_s(self) -> float:
        return self.inter_bytes * 8 / (self.network.inter_gbps * 1e9)

    @property
    def network_s(self) -> float:
        return self.intra_s + self.inter_s

    @property
    def network_bound(self) -> bool:
        """The collectives take longer than the compute they could overlap with."""
        return self.network_s > self.compute_s

    def to_dict(self) -> dict:
        return {"intra_node_bytes": round(self.intra_bytes), "inter_node_bytes": round(self.inter_bytes),
                "intra_node_s": self.intra_s, "inter_node_s": self.inter_s, "compute_s": self.compute_s,
                "network_bound": self.network_bound,
                "parts": [{"what": w, "intra_node_bytes": round(a), "inter_node_bytes": round(b)}
                          for w, a, b in self.parts],
                "assumed": {"intra_gbps": self.network.intra_gbps, "inter_gbps": self.network.inter_gbps,
                            "peak_tflops": self.network.peak_tflops, "mfu": self.network.mfu}}


def _flat(what: str, sent: float, gpus: int, nodes: int) -> tuple[str, float, float]:
    """A collective over every GPU of the job: 1/gpus of what a GPU sends crosses nodes (when there are several)."""
    inter = sent / gpus if nodes > 1 else 0.0
    return what, sent - inter, inter


def gathered_bytes(shape: ModelShape, spec: TrainSpec, *, trained_params: int) -> float:
    """What FSDP all-gathers per pass: every parameter in the dtype it computes in (bf16 under mixed precision), a
    4-bit base as stored (4 bits and the quantisation constants a weight), and LoRA's trained parameters."""
    compute = DTYPE_BYTES[PRECISION_DTYPE.get(spec.mixed_precision, spec.dtype)]
    if spec.method == "full":
        return float(shape.params_total * compute)
    base = float(shape.params_total * compute)
    if spec.quantize:
        quantized = shape.linear_params_per_layer * shape.layers
        base = quantized * QUANT_BYTES_PER_WEIGHT + (shape.params_total - quantized) * DTYPE_BYTES[spec.dtype]
    return base + trained_params * compute


def data_parallel(spec: TrainSpec, *, trainable_bytes: float, gathered: float) -> tuple[tuple[str, float, float], ...]:
    """Per-GPU bytes of one optimizer step for spec's strategy over its GPUs and nodes."""
    g, m, a = spec.num_gpus, spec.num_nodes, spec.grad_accum
    if spec.strategy == "single" or spec.world == 1:
        return ()
    if spec.strategy == "ddp":
        return (_flat("all-reduce of the trainable gradients", all_reduce(trainable_bytes, spec.world), g, m),)
    if spec.strategy == "fsdp":
        n = spec.world
        return (_flat(f"all-gather of the parameters, forward and backward x {a} micro-batches",
                      2 * a * all_gather(gathered, n), g, m),
                _flat("reduce-scatter of the trainable gradients", reduce_scatter(trainable_bytes, n), g, m))
    # hsdp: shard within a node, replicate across nodes
    parts = [(f"all-gather of the parameters within the node, forward and backward x {a} micro-batches",
              2 * a * all_gather(gathered, g), 0.0),
             ("reduce-scatter of the trainable gradients within the node", reduce_scatter(trainable_bytes, g), 0.0)]
    if m > 1:
        parts.append(("all-reduce of the gradient shard across the replicas", 0.0,
                      all_reduce(trainable_bytes / g, m)))
    return tuple(parts)


def tensor_parallel(shape: ModelShape, *, tokens: int, tp: int, act_bytes: int = 2) -> float:
    """Per-GPU bytes of one micro-batch of `tokens` tokens under tensor parallelism over tp GPUs: 4 all-reduces
    of the activations (tokens x hidden) per decoder layer (2 forward, 2 backward)."""
    return 4 * shape.layers * all_reduce(tokens * shape.hidden * act_bytes, tp) if tp > 1 else 0.0


def step_flops(shape: ModelShape, spec: TrainSpec, trainable_linear_share: float) -> float:
    """Model FLOPs of one GPU's optimizer step, as llmtrain's MFU counts them (metrics.flop_model): 6 per
    trained and 4 per frozen matrix parameter per token, and attention's 6 L heads head_dim per l^2, with every
    example seq_len long (a token budget: as many full-length examples as fit)."""
    tokens = spec.tokens * spec.grad_accum
    body = shape.layers * shape.linear_params_per_layer * (4 + 2 * trainable_linear_share)
    head = shape.vocab * shape.hidden * (6 if spec.method == "full" else 4)
    attn = 6.0 * shape.layers * shape.heads * shape.head_dim * tokens * min(spec.seq_len, spec.tokens)
    return tokens * (body + head) + attn


def traffic(shape: ModelShape, spec: TrainSpec, *, trained_params: int, trainable_bytes: float,
            network: Network = Network()) -> Traffic:
    """One GPU's traffic and compute time per optimizer step; trainable_bytes are the gradients as they are
    reduced (the trained parameters in their master dtype)."""
    gathered = gathered_bytes(shape, spec, trained_params=trained_params)
    share = 1.0 if spec.method == "full" else 0.0
    compute = step_flops(shape, spec, share) / (network.peak_tflops * 1e12 * network.mfu)
    return Traffic(data_parallel(spec, trainable_bytes=trainable_bytes, gathered=gathered), compute, network)


def step_traffic(shape: ModelShape, spec: TrainSpec, network: Network = Network()) -> Traffic:
    """traffic() for the run spec describes: its trained parameters and the bytes of their gradients."""
    from llmtrain.memory.estimate import states
    from llmtrain.memory.params import lora_plan

    plan = lora_plan(shape, r=spec.lora_r, targets=spec.lora_targets,
                     modules_to_save=spec.lora_modules_to_save) if spec.method == "lora" else None
    whole = spec.but(cpu_offload=False)
    gradients = states(shape, whole, plan).grads * whole.shards  # one GPU's shard times the shards
    trained = shape.params_total if plan is None else plan.trainable(shape)
    return traffic(shape, spec, trained_params=trained, trainable_bytes=gradients, network=network)
