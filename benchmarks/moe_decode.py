"""The fast sampler on a mixture of experts under LoRA: the experts' adapters beside the base experts
(model/lora_experts.py, what llmtrain runs) against peft's own forward, which merges every expert of a layer
(W + s B A) at every decode step; and, for scale, without LoRA and with LoRA on attention alone.

    OMP_NUM_THREADS=2 python benchmarks/moe_decode.py            # CPU, fp32: a Qwen3-MoE of hidden 512, 64 experts
    python benchmarks/moe_decode.py --dtype bfloat16              # on a GPU
    python benchmarks/moe_decode.py --family gpt_oss              # GPT-OSS: biased experts, LoRA on them by
                                                                  # lora.target_parameters, the reference sampler

Prints one JSON line a configuration: seconds (best of --repeat) for --rows rows of --new-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch


def shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The small Qwen3-MoE's (or GPT-OSS's) options, shared with benchmarks/moe_lora_step.py."""
    ap.add_argument("--family", choices=("qwen3_moe", "gpt_oss"), default="qwen3_moe")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-columns", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")


def moe_config(args):
    from transformers import AutoConfig

    if args.family == "gpt_oss":  # its eager attention (sinks; it has no SDPA) and 128-token window every other layer
        return AutoConfig.for_model(
            "gpt_oss", hidden_size=args.hidden, intermediate_size=args.expert_columns, num_local_experts=args.experts,
            num_experts_per_tok=args.top_k, num_hidden_layers=args.layers, num_attention_heads=8,
            num_key_value_heads=2, head_dim=args.hidden // 8, vocab_size=4096, sliding_window=128,
            attn_implementation="eager")
    return AutoConfig.for_model(
        "qwen3_moe", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_columns, num_experts=args.experts, num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=args.hidden // 8,
        vocab_size=4096, attn_implementation="sdpa")


def lora_moe(config, args, device: str, targets, *, unmerged: bool):
    """The small Qwen3-MoE (seed 0) in args.dtype on `device`, under LoRA r16 on `targets` (None: none; GPT-OSS's
    experts by target_parameters beside them, as its recipes do); unmerged: its adapted experts run beside the base
    ones, as model/modeling.apply_lora installs them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.model import lora_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=getattr(torch, args.dtype))
    if targets:
        parameters = (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
                      if config.model_type == "gpt_oss" and targets == "all-linear" else None)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0,
                                                 target_parameters=parameters))
        if unmerged:
            lora_experts.install(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    shape_arguments(ap)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from llmtrain.model.fast_sample import sample_fast, supports
    from llmtrain.model.generate import sample

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = moe_config(args)
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(31)] for i in range(args.rows // 4) for _ in range(4)]
    cases = [("no LoRA", None, True), ("LoRA on attention", ["q_proj", "k_proj", "v_proj", "o_proj"], True),
             ("LoRA all-linear, experts unmerged", "all-linear", True),
             ("LoRA all-linear, peft's merge", "all-linear", False)]
    for name, targets, unmerged in cases:
        model = lora_moe(config, args, device, targets, unmerged=unmerged).eval()
        # what rollouts run (fast_sample.sampler_for): GPT-OSS's sinks are outside the fast sampler's layer
        draw = partial(sample_fast, copy="rollout") if supports(model) else sample
        seconds = []
        for _ in range(args.repeat + 1):  # the first round warms up
            t = time.perf_counter()
            draw(model, prompts, seeds=list(range(len(prompts))), max_new_tokens=args.new_tokens, temperature=1.0,
                 top_p=1.0, stop_ids=set(), pad_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)
        best = min(seconds[1:])
        print(json.dumps({"case": name, "sampler": "fast" if draw is not sample else "reference",
                          "seconds": round(best, 3), "tokens_per_s": round(len(prompts) * args.new_tokens / best, 1),
                          "device": device, "dtype": args.dtype}), flush=True)


if __name__ == "__main__":
    main()
