"""Sampling speed for online RL: the reference loop (model/generate.sample) against the fast sampler
(model/fast_sample.py, eager static cache and CUDA graph), as GRPO's rollout calls them, with and without its merged
generation copy (rl.merged_copy: the `-merged` samplers) and finished rows dropped from the batch (the `-before`
samplers have neither).

For each number of completions (prompts x --generations) and of new tokens: generated tokens/s, ms per decode
step, the completions' lengths and the peak memory, one JSON line each. Prompts are ~--prompt-tokens long (GSM8K
questions through the chat template where --gsm8k is given, else random ids). --lengths limit: no stop tokens (every
completion runs to the limit: the worst case); --lengths gsm8k: stop tokens that end completions after GSM8K's mean
reply length on average (random-init weights draw near uniformly: geometric lengths), where dropping finished rows
pays. The slow samplers can be timed over fewer new tokens (--cap reference=64: the line says so).

  # Mistral-7B LoRA, random init, on a GPU (benchmarks/gpu_session.sh rl runs this)
  python benchmarks/rollouts.py --model .gpu/mistral --gsm8k .gpu/gsm8k/train.jsonl --lora 16 --dtype bfloat16
  python benchmarks/rollouts.py --model .gpu/mistral --gsm8k .gpu/gsm8k/train.jsonl --lora 16 --dtype bfloat16 \
      --lengths gsm8k --new-tokens 512 --completions 16 64 --samplers graph-before graph graph-merged
  # the tiny model on the CPU
  python benchmarks/rollouts.py --model assets/tiny/model --completions 16 64 256 --new-tokens 12 64 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from llmtrain.model.fast_sample import sample_fast
from llmtrain.model.generate import completion_seed, sample


def build(path: str, *, dtype: str, lora: int, device: str):
    """The model at `path`: its weights where the folder has them, else a random init of its config; all-linear
    LoRA of rank `lora` (0: none) with a non-zero B, so the adapters are in every token's cost."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # a random init, the same each time
    kwargs = dict(dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if any(Path(path).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **kwargs)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=1e-3)
    return model.eval()


def prompts_of(n: int, tokens: int, *, tokenizer_dir: str, gsm8k: str | None, vocab: int) -> list[list[int]]:
    """n prompts of about `tokens` tokens: GSM8K questions in the chat template (cut or repeated to the length),
    else random ids."""
    rng = random.Random(0)
    if gsm8k:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        rows = [json.loads(line)["question"] for line in open(gsm8k)][: 4 * n]
        out = []
        for q in rows[:n]:
            text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append((ids * (tokens // len(ids) + 1))[: tokens + rng.randrange(-tokens // 5, tokens // 5)])
        return out
    return [[1] + [rng.randrange(3, vocab) for _ in range(tokens + rng.randrange(-tokens // 5, tokens // 5))]
            for _ in range(n)]


def timed(fn, lm, prompts, *, new_tokens: int, cuda: bool, stop_ids=frozenset(), **kw) -> dict:
    seeds = [completion_seed(1, 0, i // 8, i % 8) for i in range(len(prompts))]
    if cuda:  # from an empty cache: what the call reserves (a captured graph's private pool included) is its own
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    begun = time.perf_counter()
    out = fn(lm, prompts, seeds=seeds, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, stop_ids=set(stop_ids),
             pad_id=0, **kw)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begun
    generated = sum(map(len, out))
    return {"seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds,
            "ms_per_step": 1e3 * seconds / new_tokens, **length_stats(out),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            # issue 53, item 14: what stays reserved after the call beside what stays allocated (the graphs' pool and
            # the freed KV cache, held by the caching allocator), and the reserved peak
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            "reserved_after_gib": torch.cuda.memory_reserved() / 2**30 if cuda else None,
            "allocated_after_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None, "_out": out}


def reply_lengths(gsm8k: str, tokenizer_dir: str) -> list[int]:
    """GSM8K's reference replies (the answer column) in the model's tokens: what a trained policy's completions run to."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    answers = [json.loads(line)["answer"] for line in open(gsm8k)]
    return [len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers]  # + the end of turn


def stops_for_lengths(mean: float, vocab: int, *, seed: int = 0) -> set[int]:
    """Stop tokens that end a random-init model's completions after `mean` tokens on average: at temperature 1 its
    next-token distribution is near uniform, so vocab / mean stop ids stop a row with probability about 1 / mean a
    token (geometric lengths: a wider spread than GSM8K's; each line reports the lengths drawn)."""
    rng = random.Random(seed)
    return set(rng.sample(range(3, vocab), max(1, round(vocab / mean))))


def length_stats(out: list[list[int]]) -> dict:
    lengths = sorted(map(len, out))
    at = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {"length_mean": sum(lengths) / len(lengths), "length_p10": at(0.1), "length_p50": at(0.5),
            "length_p90": at(0.9)}


# name: (capture, rl.merged_copy, finished rows dropped): static and graph as rl.sampler runs them by default (rows
# dropped, adapters unmerged); -merged: on a merged copy (rl.merged_copy=rollout); -before: neither (as before issue 56)
SAMPLERS = {"reference": None, "static-before": (False, "off", False), "static": (False, "off", True),
            "static-merged": (False, "rollout", True), "graph-before": (True, "off", False),
            "graph": (True, "off", True), "graph-merged": (True, "rollout", True)}


def sampler(name: str):
    if SAMPLERS[name] is None:
        return sample
    capture, copy, compact = SAMPLERS[name]
    return lambda *a, **k: sample_fast(*a, capture=capture, copy=copy, compact=compact, **k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder (config + tokenizer; weights optional)")
    ap.add_argument("--gsm8k", help="GSM8K train.jsonl: real prompts in the chat template")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lora", type=int, default=16, help="all-linear LoRA rank (0: none)")
    ap.add_argument("--completions", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--samplers", nargs="+", default=["reference", "static-before", "static", "graph-before", "graph",
                                                      "graph-merged"], choices=sorted(SAMPLERS),
                    help="static/graph: as rl.sampler runs them (finished rows dropped); -merged: also on a merged "
                         "copy (rl.merged_copy=rollout); -before: neither")
    ap.add_argument("--lengths", choices=["limit", "gsm8k"], default="limit",
                    help="limit: no stop tokens, every completion runs to the limit (the worst case); gsm8k: stop "
                         "tokens that end completions after GSM8K's mean reply length (needs --gsm8k)")
    ap.add_argument("--cap", nargs="*", default=["reference=64"],
                    help="sampler=tokens: time that sampler over at most this many new tokens (the reference is slow)")
    ap.add_argument("--skip", nargs="*", default=[], help="completions:new_tokens pairs to leave out, e.g. 256:1024")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    caps = {k: int(v) for k, v in (c.split("=") for c in args.cap)}
    measured = set()  # (sampler, completions, new tokens) already timed
    lm = build(args.model, dtype=args.dtype, lora=args.lora, device="cuda" if cuda else "cpu")
    vocab = lm.config.vocab_size if hasattr(lm, "config") else 32000
    stops, header = set(), {}
    if args.lengths == "gsm8k":
        replies = reply_lengths(args.gsm8k, args.model)
        mean = sum(replies) / len(replies)
        stops = stops_for_lengths(mean, vocab)
        header = {"lengths": "gsm8k", "gsm8k_reply_tokens": {"mean": mean, **{
            k: v for k, v in length_stats([[0] * n for n in replies]).items() if k != "length_mean"}},
            "stop_ids": len(stops)}
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                      "model": args.model, "dtype": args.dtype, "lora": args.lora, **header}), flush=True)
    for n in args.completions:
        distinct = prompts_of(max(n // args.generations, 1), args.prompt_tokens, tokenizer_dir=args.model,
                              gsm8k=args.gsm8k, vocab=vocab)
        prompts = [p for p in distinct for _ in range(args.generations)][:n]
        for new in args.new_tokens:
            if f"{n}:{new}" in args.skip:
                continue
            firsts = {}
            for name in args.samplers:
                if name.startswith("graph") and not cuda:
                    continue
                steps = min(new, caps.get(name, new))
                if (name, n, steps) in measured:  # capped: this length was timed already at a shorter --new-tokens
                    continue
                measured.add((name, n, steps))
                # warm-up at the timed rows (kernels and cuBLAS's choices for these shapes, the allocator): with 8 of
                # them, the first sampler of a process ran 35% slower at 16 rows on the H200 (2026-12-04)
                timed(sampler(name), lm, prompts, new_tokens=4, cuda=cuda)
                r = timed(sampler(name), lm, prompts, new_tokens=steps, cuda=cuda, stop_ids=stops)
                out = r.pop("_out")
                firsts[name] = [c[:steps] for c in out]
                line = {"sampler": name, "completions": n, "prompts": len(distinct),
                        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts), "new_tokens": steps, **r}
                if steps < new:
                    line["note"] = f"timed over {steps} of {new} new tokens"
                print(json.dumps(line), flush=True)
            # the samplers' tokens, compared over the tokens both drew (bf16: a tie can flip a token, then the rest)
            names = list(firsts)
            for other in names[1:]:
                a, b = firsts[names[0]], firsts[other]
                same = sum(x == y for x, y in zip(a, b))  # each cut to the tokens both samplers were timed over
                print(json.dumps({"compare": f"{names[0]} vs {other}", "completions": n,
                                  "identical_completions": same, "of": len(a)}), flush=True)


if __name__ == "__main__":
    main()
