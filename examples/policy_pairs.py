"""Preference pairs from a policy's own samples, for training a reward model that GRPO can learn from.

A reward model for online RL must rank the policy's own samples of one prompt (GRPO learns from the differences
within a group), not only a right answer against a made-up near miss. This script does what the labelling stage of
RLHF does: it samples K completions of every prompt from the policy, labels each against the row's `completion` with
llmtrain's `answer_match` reward (equal after stripping whitespace; here the stand-in for a person's judgement), and
writes one pair per distinct wrong sample, the row's answer as `chosen` and the sample as `rejected`
(docs/reward-models.md, "A learned reward for GRPO").

    python examples/policy_pairs.py runs/tiny-sft/final assets/tiny/data/train.jsonl runs/tiny-rm-pairs/train.jsonl
    python examples/policy_pairs.py runs/tiny-sft/final assets/tiny/data/eval.jsonl runs/tiny-rm-pairs/eval.jsonl

Rows are `{"prompt": ..., "completion": ...}` text (the tiny task's format); prompts are tokenized as text, as
llmtrain's GRPO renders a `format: prompt` row without a chat template.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from llmtrain.objectives.rewards import answer_match


def label(rows: list[dict], samples: list[list[str]]) -> list[list[bool]]:
    """Whether each sample of each row is right: GRPO's answer_match reward on the row's `completion` column."""
    reward = answer_match(None, column="completion")
    return [[score == 1.0 for score in reward([row["prompt"]] * len(group), group,
                                              completion=[row["completion"]] * len(group))]
            for row, group in zip(rows, samples, strict=True)]


def pairs_from_samples(rows: list[dict], samples: list[list[str]], right: list[list[bool]],
                       seed: int = 0) -> list[dict]:
    """One pair per distinct wrong, non-empty sample of each row: the row's answer chosen, the sample rejected.

    samples[i] are row i's completions and right[i] their labels (`label`). The pairs are shuffled with `seed` so
    that a prefix of the file mixes prompts.
    """
    pairs = []
    for row, completions, labels in zip(rows, samples, right, strict=True):
        seen = set()
        for text, is_right in zip(completions, labels, strict=True):
            if is_right or not text.strip() or text in seen:
                continue
            seen.add(text)
            pairs.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": text})
    random.Random(seed).shuffle(pairs)
    return pairs


def sample(policy: str, prompts: list[str], k: int, temperature: float, max_new_tokens: int, seed: int,
           batch_size: int = 64) -> list[list[str]]:
    """k completions of each prompt from the policy (transformers' generate, plain sampling at `temperature`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    out: list[list[str]] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True)
            ids = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, num_return_sequences=k,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            out += [texts[i:i + k] for i in range(0, len(texts), k)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="the policy's model folder (a causal LM)")
    parser.add_argument("data", type=Path, help="JSONL rows with prompt and completion (the right answer)")
    parser.add_argument("out", type=Path, help="where to write the pairs (JSONL: prompt, chosen, rejected)")
    parser.add_argument("--samples", type=int, default=16, help="completions a prompt (GRPO's num_generations)")
    parser.add_argument("--temperature", type=float, default=0.5, help="the temperature GRPO samples at")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--limit", type=int, default=None, help="only the first N rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    numbered = [(n, json.loads(line)) for n, line in enumerate(args.data.read_text().splitlines(), 1) if line.strip()]
    for n, row in numbered[:args.limit]:
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise SystemExit(f"{args.data}, line {n}: each row needs text `prompt` and `completion` columns "
                             f"(the right answer the samples are labelled against); it has {sorted(row)}.")
    rows = [row for _, row in numbered[:args.limit]]
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or name another file (nothing was written).")
    samples = sample(args.policy, [r["prompt"] for r in rows], args.samples, args.temperature,
                     args.max_new_tokens, args.seed)
    right = label(rows, samples)
    pairs = pairs_from_samples(rows, samples, right, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    share = sum(map(sum, right)) / max(1, len(rows) * args.samples)
    print(f"{len(rows)} prompts x {args.samples} samples: {share:.1%} right; "
          f"{len(pairs)} pairs (the answer against each distinct wrong sample) written to {args.out}")


if __name__ == "__main__":
    main()
