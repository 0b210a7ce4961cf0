"""Rewards a user can compute, for online RL (GRPO): built-in ones and the user's own, with TRL's signature.

A reward function takes the prompts and the completions of a batch (text) and the dataset's other columns by name,
and returns one float per completion, or None where it does not apply (TRL's convention):

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

so a reward function written for TRL's GRPOTrainer works unchanged (`rl.rewards: [{function: module:name}]`).
Built in: `answer_match` (1.0 where the completion's answer, the first group of a pattern, equals the expected
column's, as eval_answer_accuracy compares them) and `format` (1.0 where the completion matches a pattern).
`score` runs them, checks what they return (its length, finite values), weights them and sums them: a completion
that no function scores gets NaN, which group_advantages leaves out. Whatever goes wrong stops the run with the
function's name and the row, never a reward silently taken as 0.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence

import torch

from llmtrain.errors import LLMTrainError

RewardFn = Callable[..., list]


def answer(text: str, pattern: str | None) -> str | None:
    """The answer in a reply: the first group of `pattern` (train.eval_answer_pattern) where it matches (None where
    it does not), else the whole reply, stripped."""
    if pattern is None:
        return text.strip()
    found = re.search(pattern, text)
    return found.group(1).strip() if found else None


PREPARED = ("input_ids", "labels", "length", "row", "prompt")  # what data preparation adds to a prompt row


def reward_columns(columns) -> tuple[str, ...]:
    """The columns of prepared prompt data that the reward functions get by name: all but the prompt and what
    preparation added."""
    return tuple(c for c in columns if c not in PREPARED)


def content(completion) -> str:
    """A completion's text: itself, or the content of its one assistant message (a conversational dataset, as TRL
    hands completions to reward functions)."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def answer_match(pattern: str | None, *, column: str = "answer") -> RewardFn:
    """1.0 where the completion's answer equals the expected one (the `column` of the row), else 0.0; None where the
    expected answer has none (the row cannot be scored this way)."""

    def reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        expected = columns[column]
        out: list[float | None] = []
        for completion, reference in zip(completions, expected):
            want = answer(str(reference), pattern)
            out.append(None if want is None else float(answer(content(completion), pattern) == want))
        return out

    reward.__name__ = "answer_match"
    return reward


def format_match(pattern: str) -> RewardFn:
    """1.0 where the completion matches `pattern` (re.search, `.` also matching newlines), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
        return [float(compiled.search(content(c)) is not None) for c in completions]

    reward.__name__ = "format"
    return reward


def import_reward(spec: str) -> RewardFn:
    """`module:function` (a module on sys.path, or a dotted package path) to the function, or a one-paragraph error
    naming what is missing."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise LLMTrainError(f"reward function '{spec}' is not of the form module:function (e.g. my_rewards:accuracy).")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or the module's own error while importing
        raise LLMTrainError(f"reward function '{spec}': importing {module_name} failed: {type(e).__name__}: {e}. "
                            "Put the module on PYTHONPATH (or next to where you run llmtrain).") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise LLMTrainError(f"reward function '{spec}': {module_name} has no function {name}.")
    return fn


def build_rewards(rl, *, answer_pattern: str | None, columns) -> list[tuple[str, RewardFn, float]]:
    """The recipe's rl.rewards as (name, function, weight): answer_match reads `pattern` (default
    train.eval_answer_pattern) from its column, which must be one of the data's `columns`."""
    out = []
    for r in rl.rewards:
        if r.type == "answer_match":
            if r.column not in columns:
                raise LLMTrainError(f"rl.rewards: answer_match compares with the column '{r.column}', which the data "
                                    f"does not have (its columns: {sorted(columns)}). Set the reward's column: to the "
                                    "one holding the expected answer.")
            fn = answer_match(r.pattern if r.pattern is not None else answer_pattern, column=r.column)
        elif r.type == "format":
            fn = format_match(r.pattern)
        else:
            fn = import_reward(r.function)
        out.append((r.name, fn, r.weight))
    return out


def score(functions: Sequence[tuple[str, RewardFn, float]], prompts: list[str], completions: list[str],
          columns: dict[str, list], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each function's rewards [completions x functions], NaN for None; their weighted sum [completions], NaN
    where no function applied). `functions`: (name, function, weight); `columns`: the rows' other columns, one
    value per completion; `rows`: each completion's row number in the data, for the errors."""
    per_function = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float64)
    for k, (name, fn, _) in enumerate(functions):
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:
            raise LLMTrainError(f"reward function {name} raised {type(e).__name__}: {e} (on the completions of rows "
                                f"{_rows(rows)}). Fix the function; no step was taken with its rewards.") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise LLMTrainError(f"reward function {name} returned {got} for {len(completions)} completions (rows "
                                f"{_rows(rows)}): it must return one float (or None) per completion.")
        for i, value in enumerate(values):
            if value is None:
                continue
            try:  # a float, an int, a bool, a numpy or a 0-d torch number
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number) or isinstance(value, str):
                raise LLMTrainError(f"reward function {name} returned {value!r} for the completion of row {rows[i]}: "
                                    "a reward must be a finite number, or None where the function does not apply.")
            per_function[i, k] = number
    weights = torch.tensor([w for _, _, w in functions], dtype=torch.float64)
    total = (per_function * weights).nansum(dim=1)
    total[per_function.isnan().all(dim=1)] = math.nan
    return per_function, total


def check_rewards(functions: Sequence[tuple[str, RewardFn, float]], rows: list[dict], columns: Sequence[str]) -> None:
    """Run every reward function once on the first `rows` (prompt rows as prepared: prompt, row, the other
    columns), each with an empty completion and with the prompt itself as one, before the run writes anything: a
    function that raises, returns the wrong length or a non-finite value is refused now, naming it, not at step 1."""
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    chat = bool(prompts) and isinstance(prompts[0], list)
    texts = [t for r in rows for t in ("", r["prompt"] if isinstance(r["prompt"], str) else "")]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    score(functions, prompts, completions, {c: [r[c] for r in rows for _ in range(2)] for c in columns},
          [r["row"] + 1 for r in rows for _ in range(2)])


def _rows(rows: list[int]) -> str:
    shown = sorted(set(rows))
    return ", ".join(map(str, shown[:5])) + (", ..." if len(shown) > 5 else "")
