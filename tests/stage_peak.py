"""`llmtrain finetune ARGS` with this process's second training step measured: run under accelerate launch
(`accelerate launch ... tests/stage_peak.py RECIPE [key=value ...]`), each process writes
$STAGE_PEAK_OUT/rank<R>.json with the peak of live tensor bytes during that step (every CPU tensor alive when the step
begins, found by the garbage collector: weights, optimizer state, the stages' receive buffers; then every tensor an op
makes inside it: tests/live_bytes.py), what torch.cuda.max_memory_allocated reports on a GPU. The memory estimate
of each pipeline stage is checked against it (tests/test_memory_pipeline.py)."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from live_bytes import LiveBytes  # noqa: E402

import llmtrain.loop.train as train_module  # noqa: E402

class Detailed(LiveBytes):
    """LiveBytes that keeps, at each new peak, how many live storages there are of each size (STAGE_PEAK_DETAIL=1)."""

    def track(self, *tensors):
        before = self.peak
        super().track(*tensors)
        if self.peak > before:
            from collections import Counter

            self.at_peak = Counter(self.sizes.values())


original = train_module.train_step
calls: list[int] = []


def measured_step(*args, **kwargs):
    calls.append(1)
    if len(calls) != 2:  # the first step allocates the optimizer state and the receive buffers
        return original(*args, **kwargs)
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    with (Detailed() if os.environ.get("STAGE_PEAK_DETAIL") else LiveBytes()) as live:
        live.track(*alive)
        del alive
        start = live.now
        result = original(*args, **kwargs)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["STAGE_PEAK_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak": live.peak, "start": start,
                                                           **({"at_peak": sorted(live.at_peak.items(), reverse=True)}
                                                              if hasattr(live, "at_peak") else {})}))
    return result


train_module.train_step = measured_step
torch.set_num_threads(1)

if __name__ == "__main__":
    from llmtrain.cli import main

    sys.argv = ["llmtrain", "finetune", *sys.argv[1:]]
    main()
