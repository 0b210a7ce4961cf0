"""model.activation_offload: each checkpointed decoder layer's input kept in host memory instead of on the GPU.

With gradient checkpointing a layer keeps one tensor for its backward, its input (tokens x hidden), which the backward
reruns the layer from; L layers keep L of them, the activations that grow with the context (256 KB a token on a 7B
in bf16). Here that input goes through a pack/unpack pair of saved-tensor hooks placed around the checkpoint, which
is where torch's non-reentrant checkpoint saves its inputs (`_CheckpointFrame.save_inputs`); the tensors the layer
saves inside the checkpoint are the checkpoint's own placeholders and never reach these hooks.

On CUDA (as unsloth_zoo's and DeepSpeed's offloaded checkpoints): the forward copies the input into pinned host
memory on a side stream while the compute stream moves on to the next layer; the backward, on unpacking layer k's
input, starts copying layer k-1's back on the side stream so that it arrives while layer k is recomputed (two layer
inputs on the GPU at a time). The last checkpointed layer's input stays on the GPU: its backward comes first, so a
copy out and back would only wait. Pinned memory that cannot be allocated falls back to pageable memory, with one
warning. transformers' own `offload=True` (5.24) is torch's `save_on_cpu`: the same saving, but both copies on the
compute stream, so the step waits for each of them.

On a CPU the same hooks run (the input is copied into a fresh host tensor and read back from it), so the CPU tests
exercise the saving and restoring; there is no memory to gain there.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import Counter

import torch
from torch.utils.checkpoint import checkpoint


class _Packed:
    """One offloaded layer input: its host copy and, once fetched back, its device copy."""

    __slots__ = ("device", "host", "copied", "fetched", "__weakref__")

    def __init__(self, device: torch.device, host: torch.Tensor, copied):
        self.device, self.host, self.copied, self.fetched = device, host, copied, None


class ActivationOffload:
    """The pack/unpack pair of one model, and the checkpoint function each decoder layer calls.

    `stats` counts what happened (packed, kept, unpacked, prefetched, bytes): the tests read it."""

    def __init__(self, layers: int, checkpoint_kwargs: dict):
        self.last = layers - 1
        self.kwargs = checkpoint_kwargs
        self.stats: Counter = Counter()
        self._queue: list[weakref.ref] = []  # the inputs packed and not yet unpacked, in forward order
        self._streams: dict[torch.device, object] = {}
        self._pinned = True

    def checkpoint(self, index: int, function, *args, **kwargs):
        """What layer `index` calls instead of torch.utils.checkpoint.checkpoint."""
        if index == self.last or not torch.is_grad_enabled():
            self.stats["kept"] += torch.is_grad_enabled()
            return checkpoint(function, *args, **self.kwargs, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return checkpoint(function, *args, **self.kwargs, **kwargs)

    # ------------------------------------------------------------------ forward: device -> host
    def pack(self, tensor: torch.Tensor) -> _Packed | torch.Tensor:
        if not tensor.numel():  # torch 2.11's checkpoint saves an empty tensor beside each layer's input: kept as it
            return tensor  # is, out of the queue, whose neighbours are what the backward prefetches
        tensor = tensor.detach()
        host = self._host_like(tensor)
        copied = None
        if tensor.is_cuda:
            side, compute = self._side(tensor.device), torch.cuda.current_stream(tensor.device)
            side.wait_stream(compute)  # the input is written by kernels queued on the compute stream
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=host.is_pinned())
                copied = torch.cuda.Event()
                copied.record(side)
            tensor.record_stream(side)  # the allocator must not hand its memory out before the copy has read it
        else:
            host.copy_(tensor)
        packed = _Packed(tensor.device, host, copied)
        self._queue = [r for r in self._queue if r() is not None] + [weakref.ref(packed)]
        self.stats["packed"] += 1
        self.stats["bytes"] += host.numel() * host.element_size()
        return packed

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda and self._pinned:
            try:
                return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            except RuntimeError as e:  # the OS refused to lock more pages (ulimit -l, a container's limit)
                self._pinned = False
                warnings.warn(f"model.activation_offload: pinned host memory could not be allocated ({e}); the "
                              "layer inputs go to pageable memory, whose copies are synchronous and slower.")
        return torch.empty(tensor.shape, dtype=tensor.dtype)

    def _side(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # ------------------------------------------------------------------ backward: host -> device
    def unpack(self, packed: _Packed | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):  # not packed (pack: an empty tensor)
            return packed
        tensor = self._fetch(packed)  # first: a prefetch queued before it would delay it on the side stream
        packed.fetched = None  # the recompute holds it while it needs it; a second backward fetches it again
        self.stats["unpacked"] += 1
        alive = [r() for r in self._queue]
        if packed in alive:  # the backward runs the layers in reverse: the one packed before this one is next
            at = alive.index(packed)
            if at > 0 and alive[at - 1] is not None:
                self._fetch(alive[at - 1])
                self.stats["prefetched"] += 1
            del self._queue[at]
        return tensor

    def _fetch(self, packed: _Packed) -> torch.Tensor:
        if packed.fetched is not None:
            tensor = packed.fetched
        elif packed.device.type != "cuda":
            tensor = packed.fetched = packed.host.to(packed.device, copy=True)
        else:
            side, compute = self._side(packed.device), torch.cuda.current_stream(packed.device)
            # Allocated on the compute stream, which uses it; the side stream first waits for the compute stream's
            # queued kernels, which may still read the memory this allocation reuses.
            tensor = torch.empty(packed.host.shape, dtype=packed.host.dtype, device=packed.device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                tensor.copy_(packed.host, non_blocking=packed.host.is_pinned())
                packed.copied = torch.cuda.Event()
                packed.copied.record(side)
            packed.fetched = tensor
        if packed.copied is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.copied)
        return tensor


def offload_checkpointed_inputs(model, checkpoint_kwargs: dict) -> ActivationOffload:
    """Route the checkpoint of every checkpointed decoder layer of `model` (checkpointing already enabled) through
    one ActivationOffload; returns it (also as `model.activation_offload`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    offload = ActivationOffload(len(layers), checkpoint_kwargs)
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = functools.partial(offload.checkpoint, index)
    model.activation_offload = offload
    return offload
