"""Data preparation, llmtrain against TRL's SFTTrainer, side by side on one machine, one after the other.

GSM8K's train split as conversational prompt-completion rows ({prompt: [user], completion: [assistant]}) through the
real Mistral-7B-Instruct-v0.3 tokenizer and chat template (../shared), tokenised and masked by each:
llmtrain's `tokenize_dataset` (what `prepare_datasets` runs before it caches) and TRL's `SFTTrainer._prepare_dataset`
(what SFTTrainer runs on a dataset before training; no packing, no truncation). One process each, both without a
cache. Prints rows/s for each, the ratio, and the tokens each produced (the same rows: trained-sequence tokens).

    python benchmarks/data_prep.py              # the whole train split (7,473 rows), twice over: 14,946
    python benchmarks/data_prep.py --rows 2000  # a quicker look
    python benchmarks/data_prep.py --json       # one JSON line

`--long`: long examples end to end. 64 chats of ~100K-130K tokens each (a user turn holding a long document, GSM8K
problems and solutions one after another, and an assistant answer, a few solutions), in the messages format and in
the conversational prompt-completion format, prepared by each and packed for a 131,072-token micro-batch:
llmtrain's `tokenize_dataset` (data.max_seq_len 131072) and its packing plan (`DataPlan`, micro_batch_tokens
131072), against TRL's `_prepare_dataset` with packing (max_length 131072, `pack_dataset`'s BFD). TRL masks the
messages rows with `assistant_only_loss` where it has a training template for Mistral's, else trains every token
(said in the output). Prints tokens/s for each and the ratio.

    python benchmarks/data_prep.py --long              # 64 chats of each format
    python benchmarks/data_prep.py --long --rows 8     # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def gsm8k_rows(n: int) -> list[dict]:
    rows = [json.loads(line) for line in (SHARED / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()]
    rows = (rows * (n // len(rows) + 1))[:n]
    return [{"prompt": [{"role": "user", "content": r["question"]}],
             "completion": [{"role": "assistant", "content": r["answer"]}]} for r in rows]


def llmtrain_prep(dataset, tokenizer) -> tuple[float, int]:
    from llmtrain.config import DataConfig
    from llmtrain.data.prepare import tokenize_dataset

    cfg = DataConfig(path="gsm8k.jsonl", format="prompt_completion", max_seq_len=1 << 20)
    start = time.perf_counter()
    train, _ = tokenize_dataset(dataset, tokenizer, cfg, "gsm8k")
    return time.perf_counter() - start, sum(train["length"])


def trl_prep(dataset, tokenizer) -> tuple[float, int]:
    from types import SimpleNamespace

    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_length=None, completion_only_loss=True, report_to=[], use_cpu=True,
                         bf16=False,
                         dataset_num_proc=None)
        trainer = SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=True)
        start = time.perf_counter()
        prepared = SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, packing=False, formatting_func=None,
                                               dataset_name="train")
        return time.perf_counter() - start, sum(len(ids) for ids in prepared["input_ids"])


LONG_BUDGET = 131072


def long_rows(n: int, fmt: str, tokenizer) -> list[dict]:
    """`n` chats, the user's document ~100K-130K tokens long (spread evenly), deterministic; each total under
    LONG_BUDGET so that neither side truncates."""
    rows = [json.loads(line) for line in (SHARED / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()]
    pieces = [f"Problem: {r['question']}\nSolution: {r['answer']}\n\n" for r in rows]
    sample = "".join(pieces[:200])
    chars_per_token = len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])
    out, at = [], 0
    for i in range(n):
        want = int((100_000 + 28_000 * i / max(n - 1, 1)) * chars_per_token)
        doc, size = [], 0
        while size < want:
            doc.append(pieces[at % len(pieces)])
            size, at = size + len(doc[-1]), at + 1
        answer = " ".join(rows[(at + k) % len(rows)]["answer"] for k in range(8))
        user = {"role": "user", "content": "Read these worked problems, then solve the last ones.\n\n" + "".join(doc)}
        reply = {"role": "assistant", "content": answer}
        out.append({"messages": [user, reply]} if fmt == "messages" else {"prompt": [user], "completion": [reply]})
    return out


def llmtrain_long(dataset, tokenizer, fmt: str) -> tuple[float, int, int]:
    """Seconds, tokens and bins of llmtrain's preparation: tokenise and mask, then the packing plan of epoch 0."""
    from llmtrain.config import DataConfig
    from llmtrain.data.batching import DataPlan
    from llmtrain.data.prepare import tokenize_dataset

    cfg = DataConfig(path="long.jsonl", format=fmt, max_seq_len=LONG_BUDGET)
    start = time.perf_counter()
    train, stats = tokenize_dataset(dataset, tokenizer, cfg, "long")
    plan = DataPlan(train["length"], seed=0, world=1, micro_batch_size=1, micro_batch_tokens=LONG_BUDGET)
    bins = plan.bins()
    assert stats.truncated == 0, "a long row was truncated: lower its length"
    return time.perf_counter() - start, sum(train["length"]), bins


def trl_long(dataset, tokenizer, fmt: str) -> tuple[float, int, int, str]:
    """Seconds, tokens, packed rows and how the rows were masked, of SFTTrainer's preparation with packing."""
    from types import SimpleNamespace

    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import get_training_chat_template

    template, masked = None, fmt == "prompt_completion"
    if fmt == "messages":
        try:  # what SFTTrainer.__init__ does for assistant_only_loss
            template, masked = get_training_chat_template(tokenizer), True
        except Exception:  # no training template for this chat template: SFTTrainer refuses; train every token
            template = None
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_length=LONG_BUDGET, packing=True, packing_strategy="bfd",
                         completion_only_loss=fmt == "prompt_completion",
                         assistant_only_loss=masked and fmt == "messages", report_to=[], use_cpu=True, bf16=False,
                         dataset_num_proc=None)
        trainer = SimpleNamespace(_tokenizer=tokenizer, chat_template=template,
                                  completion_only_loss=fmt == "prompt_completion")
        start = time.perf_counter()
        packed = SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, packing=True, formatting_func=None,
                                             dataset_name="train")
        seconds = time.perf_counter() - start
        tokens = sum(sum(s) for s in packed["seq_lengths"])
    how = "completion mask" if fmt == "prompt_completion" else ("assistant mask" if masked else "no mask (all tokens)")
    return seconds, tokens, len(packed), how


def long_main(rows: int, as_json: bool) -> None:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "models" / "mistral-7b-instruct-v0.3")
    for fmt in ("messages", "prompt_completion"):
        chats = long_rows(rows, fmt, tokenizer)
        ours_s, ours_tokens, ours_bins = llmtrain_long(datasets.Dataset.from_list(chats), tokenizer, fmt)
        trl_s, trl_tokens, trl_bins, how = trl_long(datasets.Dataset.from_list(chats), tokenizer, fmt)
        result = {"format": fmt, "rows": rows, "llmtrain_tokens_per_s": round(ours_tokens / ours_s),
                  "trl_tokens_per_s": round(trl_tokens / trl_s), "ratio": round(trl_s / ours_s, 2),
                  "llmtrain_tokens": ours_tokens, "trl_tokens": trl_tokens, "llmtrain_bins": ours_bins,
                  "trl_packed_rows": trl_bins, "trl_labels": how}
        if as_json:
            print(json.dumps(result))
        else:
            print(f"{fmt}, {rows} chats, {ours_tokens:,} tokens: llmtrain {result['llmtrain_tokens_per_s']:,} "
                  f"tokens/s ({ours_s:.1f} s, {ours_bins} bins), TRL {result['trl_tokens_per_s']:,} tokens/s "
                  f"({trl_s:.1f} s, {trl_bins} packed rows, {how}, {trl_tokens:,} tokens): {result['ratio']}x TRL",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="14,946 rows; 64 chats with --long")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--long", action="store_true", help="100K-130K-token chats, packed to 131,072 tokens")
    a = parser.parse_args()
    if not (SHARED / "models" / "mistral-7b-instruct-v0.3").is_dir():
        sys.exit("needs ../shared/models/mistral-7b-instruct-v0.3 and ../shared/data/gsm8k")
    if a.long:
        return long_main(a.rows or 64, a.json)
    a.rows = a.rows or 14946
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "models" / "mistral-7b-instruct-v0.3")
    rows = gsm8k_rows(a.rows)
    ours_s, ours_tokens = llmtrain_prep(datasets.Dataset.from_list(rows), tokenizer)
    trl_s, trl_tokens = trl_prep(datasets.Dataset.from_list(rows), tokenizer)
    result = {"rows": a.rows, "llmtrain_rows_per_s": round(a.rows / ours_s, 1),
              "trl_rows_per_s": round(a.rows / trl_s, 1), "ratio": round(trl_s / ours_s, 2),
              "llmtrain_tokens": ours_tokens, "trl_tokens": trl_tokens}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{a.rows:,} rows: llmtrain {result['llmtrain_rows_per_s']:,} rows/s, TRL {result['trl_rows_per_s']:,} "
              f"rows/s: {result['ratio']}x TRL; tokens {ours_tokens:,} and {trl_tokens:,}")


if __name__ == "__main__":
    main()
