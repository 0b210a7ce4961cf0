"""bitsandbytes' 8-bit AdamW on sharded parameters (FSDP, HSDP, FSDP x TP, FSDP-sharded pipeline stages).

bitsandbytes updates plain tensors: its kernels take a parameter, its gradient and the two moments blockwise-quantised
to 8 bits (one fp32 absmax per block of 256 elements of the flattened tensor). Under FSDP a parameter is a DTensor
whose process holds a shard. AdamW is elementwise, so each process updates its own shard with bitsandbytes' kernel
on the plain local tensors (`to_local`, views of the same storage), and keeps the moments as DTensors laid out as
the parameter is: torch's distributed checkpoint then saves and reads them by name with the weights, one file per
rank, as it does torch's AdamW's moments.

Two choices keep it one process's optimizer:
- 8-bit or 32-bit moments is decided on the whole parameter's size (bitsandbytes keeps 32-bit ones below
  min_8bit_size, 4,096 elements), not on the shard's, as one process decides it.
- A shard's blocks of 256 start at the shard's first element. Where every shard holds a multiple of 256 elements
  (a weight with 4,096 columns split by rows, as every 7B layer is), they are one process's blocks and the update
  is one process's update. The per-block absmax of a shard is a DTensor of a synthetic length (each process's
  blocks padded to the most any process holds): there it is one process's absmax, and a checkpoint of it reads onto
  any shards of whole blocks (the distributed checkpoint moves each piece to its new owner); elsewhere onto the same
  shards only. A resume on other shards is refused before it loads (resume_problem, called by
  run/checkpoint.load_checkpoint; a pipeline stage's files, which hold each moment whole with its number of shards, by
  parallel/pipeline/checkpoint.read_stages: on the same number, or where both numbers split whole blocks,
  `whole_blocks`).
"""

from __future__ import annotations

import math
from pathlib import Path

import bitsandbytes as bnb
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

BLOCK = 256  # bitsandbytes' block of the 8-bit optimizer's blockwise quantisation


def shard_blocks(p: DTensor) -> int:
    """The most blocks of 256 that any process's shard of `p` holds: each mesh dimension that shards a tensor
    dimension divides it, rounded up (torch's chunks: the first ones are the largest)."""
    shape = list(p.shape)
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            shape[placement.dim] = math.ceil(shape[placement.dim] / p.device_mesh.size(dim))
    return math.ceil(math.prod(shape) / BLOCK)


def shards_of(t: torch.Tensor) -> int:
    """Into how many pieces a DTensor's placements split it (the sizes of the mesh dimensions that shard it,
    multiplied); 1 for a plain tensor. The absmax is laid out by them."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(d) for d, q in enumerate(t.placements) if isinstance(q, Shard))


def absmax_layout(p: DTensor) -> tuple[tuple[int], object, list]:
    """(global shape, mesh, placements) of the absmax of `p`'s 8-bit moments: each process's blocks (shard_blocks,
    zeros past its own) one after the other, split as `p` is over the mesh dimensions that shard it, whole over
    those that replicate it (HSDP's replicas hold the same moments)."""
    placements = [Replicate() if isinstance(q, Replicate) else Shard(0) for q in p.placements]
    return (shard_blocks(p) * shards_of(p),), p.device_mesh, placements


def whole_blocks(shape, pieces: int) -> bool:
    """Whether `pieces` shards of a tensor of `shape` split by rows (torch's chunks, as FSDP splits a pipeline stage's
    parameters) each hold whole blocks of 256 from a block boundary, none short: then the absmax laid out by
    absmax_layout over them is one process's (1 piece: one process's itself)."""
    rows = shape[0]
    return pieces == 1 or rows % pieces == 0 and rows // pieces * math.prod(shape[1:]) % BLOCK == 0


def one_process_blocks(shape, moments: list, absmax: list, absmax_size: int) -> bool:
    """Whether shards of a tensor of `shape` quantise in one process's blocks: each shard whole rows (`moments`: its
    (offsets, sizes)) starting on a block boundary, its absmax (`absmax`: (offset, size) each, in the same order) the
    blocks at that place of one process's, and no padding (`absmax_size`: the absmax's whole length, one process's).
    Then the absmax laid out by absmax_layout is one process's, and a checkpoint of it reads onto any such shards."""
    row = math.prod(shape[1:])
    if absmax_size != math.ceil(math.prod(shape) / BLOCK) or len(moments) != len(absmax):
        return False
    for (offsets, sizes), (start, blocks) in zip(moments, absmax):
        first = offsets[0] * row
        if tuple(sizes[1:]) != tuple(shape[1:]) or any(offsets[1:]) or first % BLOCK or start != first // BLOCK \
                or blocks != math.ceil(math.prod(sizes) / BLOCK):
            return False
    return True


def resume_problem(model, optimizer, folder: Path) -> str | None:
    """Why this process cannot read the 8-bit moments that checkpoint `folder` saved of its sharded parameters (None:
    it can). The blocks of 256 start at each shard's first element, so moments resume on the shards that wrote them,
    or wherever the saved shards and this launch's both quantise in one process's blocks (one_process_blocks: every
    7B layer's rows, 4,096 columns, over any number of shards that divides them): each process looks for its own
    part of every 8-bit moment and its absmax among the parts saved (a distributed checkpoint lists each one's
    offsets and sizes), or checks both layouts' blocks."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import _get_fqns
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(optimizer, AdamW8bit):
        return None
    saved = FileSystemReader(str(folder / "optimizer_0")).read_metadata().state_dict_metadata
    for name, p in model.named_parameters():
        if not (isinstance(p, DTensor) and p.requires_grad and p.numel() >= optimizer.args.min_8bit_size):
            continue
        (fqn,) = _get_fqns(model, name)
        prefix = f"optimizer.state.{fqn}.{AdamW8bit._FSDP_WRAPPED_QUANT_STATE_KEY}"
        there = {key: saved.get(f"{prefix}.{key}") for key in ("state1", "absmax1")}
        if id(p) in optimizer.thirty_two_bit():
            if getattr(getattr(there["state1"], "properties", None), "dtype", None) != torch.uint8:
                continue  # 32-bit moments: read onto any shards
            # written when an embedding's moments were 8-bit: resumed as written (the distributed checkpoint would
            # have copied its 8-bit codes into 32-bit slots as numbers)
            optimizer.thirty_two_bit().discard(id(p))
        if not all(hasattr(t, "chunks") for t in there.values()):  # not 8-bit moments: not this check's to judge
            continue
        mine, same = {}, True
        for key, (shape, mesh, placements) in (("state1", (p.shape, p.device_mesh, p.placements)),
                                               ("absmax1", absmax_layout(p))):
            sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
            mine[key] = (tuple(offsets), tuple(sizes))
            same &= tuple(there[key].size) == tuple(shape) and (0 in sizes or any(
                tuple(c.offsets) == tuple(offsets) and tuple(c.sizes) == tuple(sizes) for c in there[key].chunks))
        if same:
            continue
        chunks = {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in t.chunks) for k, t in there.items()}
        if one_process_blocks(p.shape, chunks["state1"], [(o[0], s[0]) for o, s in chunks["absmax1"]],
                              there["absmax1"].size[0]) and one_process_blocks(
                p.shape, [mine["state1"]], [(mine["absmax1"][0][0], mine["absmax1"][1][0])],
                absmax_layout(p)[0][0]):
            continue
        parts = len(chunks["absmax1"])
        return (f"checkpoint {folder} holds train.optimizer=adamw_8bit's moments of {fqn} quantised in blocks of each "
                f"of its {parts} shard{'s' if parts > 1 else ''}, and this launch shards it otherwise: bitsandbytes' "
                "blocks of 256 elements start at each shard's first element, so 8-bit moments resume on the shards "
                "that wrote them, or where both layouts split whole rows into whole blocks (not so here). Resume it "
                "with the launch that wrote it (its accelerate config and number of processes), or start a new run "
                "in another output_dir.")
    return None


class AdamW8bit(bnb.optim.AdamW8bit):
    """bnb.optim.AdamW8bit, plus parameters that are DTensors (plain ones are bitsandbytes' own path), and 32-bit
    moments for the parameters `embeddings()` names (ids: every nn.Embedding's weight, modeling.build_optimizer), as
    HF Trainer's adamw_bnb_8bit and peft's LoRA+ optimizer register them with bitsandbytes (its process-wide registry
    matches parameters by id when the optimizer first steps, and outlives the optimizer). They are looked up when the
    optimizer first needs them, after FSDP's or tensor parallelism's prepare has put its parameters in the modules;
    the groups stay as they are (a group of their own had put one stage's scheduler out of step with the main
    process's, which Accelerate reads into every process)."""

    def __init__(self, params, *, embeddings=None, **kwargs):
        super().__init__(params, **kwargs)
        self._embeddings, self._thirty_two = embeddings, None

    def thirty_two_bit(self) -> set[int]:
        """The ids of the parameters whose moments are 32-bit whatever their size."""
        if self._thirty_two is None:
            self._thirty_two = set(self._embeddings()) if self._embeddings is not None else set()
        return self._thirty_two

    def get_config(self, gindex, pindex, group):
        config = super().get_config(gindex, pindex, group)
        if id(group["params"][pindex]) in self.thirty_two_bit():
            config["optim_bits"] = 32
        return config

    @torch.no_grad()
    def init_state(self, group, p, gindex, pindex):
        if not isinstance(p, DTensor):
            return super().init_state(group, p, gindex, pindex)
        config = self.get_config(gindex, pindex, group)
        if config["max_unorm"] > 0.0:  # a norm over the whole update: not a shard's to take (llmtrain never sets it)
            raise NotImplementedError("bitsandbytes' max_unorm on sharded parameters")
        eight = config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
        local = p.to_local()

        def like_p(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

        state = self.state[p]
        state["step"] = 0
        dtype = torch.uint8 if eight else torch.float32
        state["state1"] = like_p(torch.zeros_like(local, dtype=dtype))
        state["state2"] = like_p(torch.zeros_like(local, dtype=dtype))
        if not eight:
            return
        if "dynamic" not in self.name2qmap:
            self.fill_qmap()
        state["qmap1"] = self.name2qmap["dynamic"] = self.name2qmap["dynamic"].to(local.device)
        state["qmap2"] = self.name2qmap["udynamic"] = self.name2qmap["udynamic"].to(local.device)
        shape, mesh, placements = absmax_layout(p)
        for key in ("absmax1", "absmax2"):
            state[key] = DTensor.from_local(torch.zeros(shard_blocks(p), dtype=torch.float32, device=local.device),
                                            mesh, placements, run_check=False, shape=shape, stride=(1,))

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        if not isinstance(p, DTensor):
            return super().update_step(group, p, gindex, pindex)
        grad = p.grad
        if grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        local = p.to_local()
        if not local.is_contiguous():  # bitsandbytes would update a contiguous copy, not the shard
            raise RuntimeError(f"a non-contiguous shard ({tuple(local.shape)}, stride {local.stride()}) of a sharded "
                               "parameter reached the 8-bit AdamW")
        state = self.state[p]
        if local.numel() == 0:  # a process past the last row of a parameter split unevenly
            state["step"] += 1
            return
        # bitsandbytes' own update on a stand-in parameter that shares the shard's storage, with the shard's state
        shard = torch.nn.Parameter(local, requires_grad=False)
        shard.grad = grad.to_local().contiguous()
        blocks = math.ceil(local.numel() / BLOCK)
        self.state[shard] = {k: (v.to_local()[:blocks] if k.startswith("absmax") else v.to_local())
                             if isinstance(v, DTensor) else v for k, v in state.items()}
        try:
            super().update_step(group, shard, gindex, pindex)
            state["step"] = self.state[shard]["step"]
        finally:
            del self.state[shard]
