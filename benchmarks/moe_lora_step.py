"""A LoRA training step on a mixture of experts: the experts' adapters beside the base experts (model/lora_experts.py,
what llmtrain trains with) against peft's own forward, which merges every expert of a layer (W + s B A) for the forward,
saves the merged copy for backward and makes its gradient, the whole parameter's size, in backward.

    OMP_NUM_THREADS=2 python benchmarks/moe_lora_step.py       # CPU, fp32: a Qwen3-MoE of hidden 512, 64 experts
    python benchmarks/moe_lora_step.py --dtype bfloat16          # on a GPU
    python benchmarks/moe_lora_step.py --family gpt_oss          # GPT-OSS's biased experts, by target_parameters

One forward and backward of --rows x --seq tokens (LoRA all-linear, r 16; the loss over every position), after one
step to warm up. Prints one JSON line a path: seconds (best of --repeat), the step's peak bytes (live tensors on the
CPU, tests/live_bytes.py; max_memory_allocated on a GPU) and the adapters' gradients' largest difference from peft's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    from moe_decode import lora_moe, moe_config, shape_arguments  # benchmarks/: the same small Qwen3-MoE

    ap = argparse.ArgumentParser()
    shape_arguments(ap)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = moe_config(args)
    ids = torch.randint(5, 4000, (args.rows, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    grads = {}
    for name, unmerged in (("experts unmerged (llmtrain)", True), ("peft's merge", False)):
        model = lora_moe(config, args, device, "all-linear", unmerged=unmerged).train()
        for n, p in model.named_parameters():  # B is zero at the start: give the adapters something to add
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)

        def step(model=model):
            model.zero_grad(set_to_none=False)
            model(input_ids=ids, labels=ids).loss.backward()

        step()  # warm-up; the gradients exist from here on
        seconds = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated()
        else:  # every live tensor, parameters and gradients included (tests/live_bytes.py)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from live_bytes import LiveBytes

            with LiveBytes() as live:
                live.track(*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), ids)
                step()
            peak = live.peak
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
        first = grads[next(iter(grads))]
        diff = max((first[n] - g).abs().max().item() for n, g in grads[name].items())
        print(json.dumps({"path": name, "seconds": round(min(seconds), 3), "peak_bytes": peak,
                          "tokens": args.rows * args.seq, "max_grad_difference": diff, "device": device,
                          "dtype": args.dtype}), flush=True)
        del model


if __name__ == "__main__":
    main()
