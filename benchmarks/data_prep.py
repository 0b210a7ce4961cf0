"""Data preparation, llmtrain against TRL's SFTTrainer, side by side on one machine, one after the other.

GSM8K's train split as conversational prompt-completion rows ({prompt: [user], completion: [assistant]}) through the
real Mistral-7B-Instruct-v0.3 tokenizer and chat template (../shared), tokenised and masked by each:
llmtrain's `tokenize_dataset` (what `prepare_datasets` runs before it caches) and TRL's `SFTTrainer._prepare_dataset`
(what SFTTrainer runs on a dataset before training; no packing, no truncation). One process each, both without a
cache. Prints rows/s for each, the ratio, and the tokens each produced (the same rows: trained-sequence tokens).

    python benchmarks/data_prep.py              # the whole train split (7,473 rows), twice over: 14,946
    python benchmarks/data_prep.py --rows 2000  # a quicker look
    python benchmarks/data_prep.py --json       # one JSON line
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=14946)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    if not (SHARED / "models" / "mistral-7b-instruct-v0.3").is_dir():
        sys.exit("needs ../shared/models/mistral-7b-instruct-v0.3 and ../shared/data/gsm8k")
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "models" / "mistral-7b-instruct-v0.3")
    rows = gsm8k_rows(a.rows)
    ours_s, ours_tokens = llmtrain_prep(datasets.Dataset.from_list(rows), tokenizer)
    trl_s, trl_tokens = trl_prep(datasets.Dataset.from_list(rows), tokenizer)
    result = {"rows": a.rows, "llmtrain_rows_per_s": round(a.rows / ours_s, 1),
              "trl_rows_per_s": round(a.rows / trl_s, 1), "ratio": round(trl_s / ours_s, 2), "llmtrain_tokens": ours_tokens, "trl_tokens": trl_tokens}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{a.rows:,} rows: llmtrain {result['llmtrain_rows_per_s']:,} rows/s, TRL {result['trl_rows_per_s']:,} "
              f"rows/s: {result['ratio']}x TRL; tokens {ours_tokens:,} and {trl_tokens:,}")


if __name__ == "__main__":
    main()
