"""`llmtrain finetune ...` with the collectives of each optimizer step recorded. tests/test_comms_measured.py launches
it as `accelerate launch --config_file X tests/count_collectives.py OUT_DIR finetune RECIPE ...`.

torch.distributed's Python collectives (what FSDP2 calls: all_gather_single, reduce_scatter_single, all_reduce) are
wrapped, and DDP, whose reducer all-reduces from C++, gets torch's default all-reduce hook, which makes the same
all-reduce of each gradient bucket through the Python dist.all_reduce. Only what runs inside llmtrain.loop.train's
train_step is kept (not loading, eval or the final gather), and not the step's scalar bookkeeping (counts, the
gradient norm, whose DTensor form all-reduces one value per parameter): tensors of at most
BOOKKEEPING elements. Each rank writes OUT_DIR/rank<N>.json: [kind, payload bytes, group
size] per collective.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

OUT = Path(sys.argv.pop(1))
RECORDS: list[tuple[str, int, int]] = []
IN_STEP = [False]
# The tiny model's smallest payload is far above this: an FSDP unit (13,312 values) or a micro-batch's activations
# (tokens x 128); the bookkeeping is a few counts, or one norm per parameter (21).
BOOKKEEPING = 1024


def _keep(kind: str, tensor, group) -> None:
    if IN_STEP[0] and tensor.numel() > BOOKKEEPING:
        RECORDS.append((kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group)))


def _wrap(name: str, kind: str, payload: str) -> None:
    original = getattr(dist, name)
    signature = inspect.signature(original)

    def recorded(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        _keep(kind, call[payload], call.get("group"))
        return original(*args, **kwargs)

    setattr(dist, name, recorded)


for name, kind, payload in [("all_gather_single", "all_gather", "output_tensor"),
                            ("all_gather_into_tensor", "all_gather", "output_tensor"),
                            ("reduce_scatter_single", "reduce_scatter", "input"),
                            ("reduce_scatter_tensor", "reduce_scatter", "input"),
                            ("all_reduce", "all_reduce", "tensor")]:
    if hasattr(dist, name):
        _wrap(name, kind, payload)


def _group_size(group) -> int:
    """Size of a functional collective's group: a (mesh, dim) pair, a mesh, a process group or its name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, tuple):
        return group[0].size(group[1])
    if hasattr(group, "mesh_dim_names"):
        return group.size()
    return dist.get_world_size(_resolve_process_group(group) if isinstance(group, str) else group)


def _wrap_functional() -> None:
    import torch.distributed._functional_collectives as funcol

    # DTensor's redistributions call the *_single forms on torch 2.13 (whose all_gather_tensor / reduce_scatter_tensor
    # call them in turn), all_gather_tensor / reduce_scatter_tensor on torch 2.11, which has no *_single form
    single = hasattr(funcol, "all_gather_single")
    for name, kind in [("all_reduce", "all_reduce"), ("all_gather_single", "all_gather"),
                       ("reduce_scatter_single", "reduce_scatter"),
                       *([] if single else [("all_gather_tensor", "all_gather"),
                                            ("reduce_scatter_tensor", "reduce_scatter")])]:
        original = getattr(funcol, name, None)
        if original is None:
            continue

        def recorded(tensor, *args, _original=original, _kind=kind, _signature=inspect.signature(original), **kw):
            group = _signature.bind(tensor, *args, **kw).arguments["group"]
            if IN_STEP[0] and tensor.numel() > BOOKKEEPING:
                n = _group_size(group)
                size = tensor.numel() * tensor.element_size() * (n if _kind == "all_gather" else 1)
                RECORDS.append((_kind, size, n))
            return _original(tensor, *args, **kw)

        setattr(funcol, name, recorded)


def _ddp_with_hook():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    def hooked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, allreduce_hook)

    DistributedDataParallel.__init__ = hooked


def _only_in_steps():
    import llmtrain.loop.train as loop

    step = loop.train_step

    def counted(*args, **kwargs):
        IN_STEP[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            IN_STEP[0] = False

    loop.train_step = counted


if __name__ == "__main__":
    _ddp_with_hook()
    _wrap_functional()
    _only_in_steps()
    from llmtrain.cli import exit_now, run

    try:
        code = run()
    finally:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(RECORDS))
    exit_now(code)
