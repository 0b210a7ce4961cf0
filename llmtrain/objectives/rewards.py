"""Rewards a user can compute, for online RL (GRPO): built-in ones and the user's own, called as TRL calls them.

A reward function gets keyword arguments as TRL 1.16's GRPOTrainer passes them (`_calculate_rewards`): the batch's
`prompts` and `completions` (text, or one assistant message each for conversational prompts), `completion_ids`
(token ids), `trainer_state` (a transformers.TrainerState: global_step, max_steps, epoch), `log_extra` and
`log_metric`, and every column of the data but the prompt, by its own name. It returns one number per completion,
or None where it does not apply; a list, a numpy array or a torch tensor:

    def my_reward(prompts, completions, completion_ids, trainer_state, **columns) -> list[float | None]

An `async def` function is awaited (several together, as TRL gathers them), so a reward function written for TRL's
GRPOTrainer works unchanged (`rl.rewards: [{function: module:name}]`). Built in: `answer_match` (1.0 where the
completion's answer, the first group of a pattern, equals the expected column's, as eval_answer_accuracy compares
them) and `format` (1.0 where the completion matches a pattern). `score` runs them, checks what they return (its
length, finite values), weights them and sums them: a completion that no function scores gets NaN, which
group_advantages leaves out. Whatever goes wrong stops the run with the function's name, the file and the row,
never a reward silently taken as 0.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from llmtrain.data.formats import pairs_note, user_columns
from llmtrain.data.tools import file_named, import_failure, user_module
from llmtrain.errors import LLMTrainError

RewardFn = Callable[..., list]


def answer(text: str, pattern: str | None) -> str | None:
    """The answer in a reply: the first group of `pattern` (train.eval_answer_pattern) where it matches (None where
    it does not), else the whole reply, stripped."""
    if pattern is None:
        return text.strip()
    found = re.search(pattern, text)
    return found.group(1).strip() if found else None


# The keyword arguments TRL passes besides the columns: a column of one of these names could not reach a function.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def reward_columns(columns) -> dict[str, str]:
    """{the user's column: where prepared prompt data keeps it} for the reward functions: every column of the data
    but the prompt, under its own name (data.formats.user_columns: apart from the columns preparation adds)."""
    return user_columns(columns)


def content(completion) -> str:
    """A completion's text: itself, or the content of its last message (a conversational dataset, as TRL hands
    completions to reward functions: one assistant message, or with tools the turns and the tools' results)."""
    if not isinstance(completion, list):
        return completion
    return next((m["content"] for m in reversed(completion) if m.get("role") == "assistant"), completion[-1]["content"])


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
    if problem := file_named(spec, "reward function"):
        raise LLMTrainError(problem)
    try:
        module = user_module(module_name)
    except Exception as e:  # an ImportError, or the module's own error while importing
        raise LLMTrainError(f"reward function '{spec}': {import_failure(module_name, e)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise LLMTrainError(f"reward function '{spec}': {module_name} has no function {name}.")
    return fn


def build_rewards(rl, *, answer_pattern: str | None, columns, data=None,
                  device=None) -> list[tuple[str, RewardFn, float]]:
    """The recipe's rl.rewards as (name, function, weight): answer_match reads `pattern` (default
    train.eval_answer_pattern) from its column, which must be one of the user's `columns` (their names as in the
    file, prepared data's column_names, as reward_columns reads them); a reward_model is loaded on `device` and
    renders prompt and completion as the data section `data` says (learned_reward.py)."""
    columns = list(reward_columns(columns))
    clash = [c for c in columns if c in TRL_ARGUMENTS]
    if clash:
        raise LLMTrainError(f"the data has a column named {clash[0]!r}, the name of an argument every reward function "
                            f"gets ({', '.join(TRL_ARGUMENTS)}), so the column could not reach them. Rename the "
                            "column in the data file.")
    out = []
    for r in rl.rewards:
        if r.type == "answer_match":
            if r.column not in columns:
                raise LLMTrainError(f"rl.rewards: answer_match compares with the column '{r.column}', which the data "
                                    f"does not have (its columns besides the prompt: {sorted(columns)}). Set the "
                                    "reward's column: to the one holding the expected answer." + pairs_note(columns))
            fn = answer_match(r.pattern if r.pattern is not None else answer_pattern, column=r.column)
        elif r.type == "format":
            fn = format_match(r.pattern)
        elif r.type == "reward_model":
            from llmtrain.objectives.learned_reward import reward_model_function

            fn = reward_model_function(r, data, device=device)
        else:
            fn = import_reward(r.function)
        out.append((r.label, fn, r.weight))
    return out


@dataclass
class RewardLogs:
    """What reward functions hand to `log_extra` (columns of rollouts.jsonl, one value per completion) and to
    `log_metric` (numbers averaged into the step's metrics line), as TRL's GRPOTrainer lets them."""

    extra: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def metric_sums(self) -> list[tuple[str, float, int]]:
        """log_metric's numbers as (name, sum, count), to be put together with the other processes' (metric_means)."""
        return [(name, sum(v), len(v)) for name, v in sorted(self.metrics.items()) if v]


def metric_means(sums: list[tuple[str, float, int]]) -> dict[str, float]:
    """One mean per name over every process's log_metric numbers ((name, sum, count) of each process, concatenated):
    each number counts once, whichever process logged it, as one process logging them all would average them."""
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, value, count in sums:
        total[name][0] += value
        total[name][1] += count
    return {name: value / count for name, (value, count) in sorted(total.items())}


def score(functions: Sequence[tuple[str, RewardFn, float]], prompts: list, completions: list, *,
          completion_ids: list[list[int]], columns: dict[str, list], rows: list[int], where: str,
          state=None, logs: RewardLogs | None = None,
          runner: AsyncRunner | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each function's rewards [completions x functions], NaN for None; their weighted sum [completions], NaN
    where no function applied). `functions`: (name, function, weight), each called with TRL's keyword arguments
    (prompts, completions, completion_ids, trainer_state `state`, log_extra and log_metric into `logs`, and
    `columns`, the user's columns by name, one value per completion); async ones are awaited together, on
    `runner`'s event loop (None: one of their own). `rows`: each completion's row in the data (1-based) and `where`
    the file, for the errors."""
    logs = logs if logs is not None else RewardLogs()
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state,
                  log_extra=logs.log_extra, log_metric=logs.log_metric, **columns)
    at = f"{where}, rows {_rows(rows)}"
    outputs: dict[int, object] = {}
    waiting: dict[int, object] = {}  # an async function's coroutine, awaited below with the others
    try:
        for k, (name, fn, _) in enumerate(functions):
            try:
                out = fn(**kwargs)
            except (Exception, SystemExit) as e:  # (sys.exit() in one had ended the run with no word)
                raise raised(name, e, at, fn) from e  # --debug's traceback goes on into the function
            (waiting if inspect.isawaitable(out) else outputs)[k] = out
        if waiting:
            with AsyncRunner() if runner is None else nullcontext(runner) as loop:
                results = loop.gather(list(waiting.values()))
            for k, out in zip(waiting, results):
                if isinstance(out, Exception):
                    raise raised(functions[k][0], out, at, functions[k][1]) from out
                outputs[k] = out
    finally:
        for coroutine in waiting.values():
            if inspect.iscoroutine(coroutine):
                coroutine.close()  # one that never ran (another function failed first): no "never awaited" warning
    per_function = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float64)
    for k, (name, _, _) in enumerate(functions):
        values = _as_list(outputs[k])
        if not isinstance(values, list) or len(values) != len(completions):
            got = (f"{len(values)} value{'s' * (len(values) != 1)}" if isinstance(values, list) else
                   type(outputs[k]).__name__)
            raise LLMTrainError(f"reward function {name} returned {got} for {len(completions)} completions ({at}): "
                                "it must return one number (or None) per completion: a list, a numpy array or a "
                                "torch tensor.")
        for i, value in enumerate(values):
            if value is None:
                continue
            try:  # a float, an int, a bool, a numpy or a 0-d torch number
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number) or isinstance(value, str):
                raise LLMTrainError(f"reward function {name} returned {value!r} for the completion of row {rows[i]} "
                                    f"of {where}: a reward must be a finite number, or None where the function does "
                                    "not apply.")
            per_function[i, k] = number
    weights = torch.tensor([w for _, _, w in functions], dtype=torch.float64)
    total = (per_function * weights).nansum(dim=1)
    total[per_function.isnan().all(dim=1)] = math.nan
    return per_function, total


class AsyncRunner:
    """One event loop on a daemon thread for a run's async reward functions, as TRL's GRPOTrainer keeps one: what a
    function opens on its first call (an HTTP client, a lock) is still on the loop at the next; and it runs whether
    or not the caller is inside an event loop itself (a notebook). Started at the first use."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None

    def gather(self, coroutines: list) -> list:
        """The coroutines run concurrently (asyncio.gather, as TRL runs them) to their results or exceptions."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="llmtrain-rewards", daemon=True).start()

        async def together():
            return await asyncio.gather(*coroutines, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(together(), self.loop).result()

    def close(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop = None

    def __enter__(self) -> AsyncRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_list(values):
    """A reward function's result as a list: a numpy array or a torch tensor (TRL takes both) becomes one."""
    if isinstance(values, torch.Tensor) or (hasattr(values, "tolist") and hasattr(values, "ndim")):
        return values.tolist() if values.ndim == 1 else values
    return list(values) if isinstance(values, tuple) else values


def raised(name: str, e: BaseException, at: str, fn=None, *, what: str = "reward function",
            on: str = "the completions of ") -> LLMTrainError:
    """The paragraph of a reward function (`what`: or an rl.environment's reset) that raised `e`: where in the
    function's own file (its innermost line there: the user's frame, which the paragraph had not named), and with
    what."""
    called = (" It is called with keyword arguments, as TRL calls it: prompts, completions, completion_ids, "
              "trainer_state, log_extra, log_metric and each column of the data by name; take **kwargs for those it "
              "does not read." if isinstance(e, TypeError) and "keyword argument" in str(e) else "")
    import traceback
    from pathlib import Path

    source = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == source and source[:1] != "<"]
    line = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return LLMTrainError(f"{what} {name} raised {type(e).__name__}: {e}{line} (on {on}{at}). Fix the function "
                         f"(--debug shows its traceback); no step was taken with its "
                         f"{'rewards' if what == 'reward function' else 'rollouts'}.{called}")


def trainer_state(recipe, *, total_steps: int | None):
    """The `trainer_state` reward functions get, a transformers.TrainerState as TRL passes its own: max_steps, the
    logging, eval and save cadence, the micro-batch; the rollout sets global_step (the steps done) and epoch."""
    from transformers import TrainerState  # only an RL run pays for importing it

    t = recipe.train
    return TrainerState(max_steps=total_steps or t.max_steps or 0, num_train_epochs=t.epochs,
                        logging_steps=recipe.logging.every_steps, eval_steps=t.eval_every_steps,
                        save_steps=recipe.checkpoint.every_steps, train_batch_size=t.micro_batch_size)


def check_rewards(functions: Sequence[tuple[str, RewardFn, float]], rows: list[dict], *, where: str,
                  state=None, runner: AsyncRunner | None = None) -> None:
    """Run every reward function once on the first `rows` (prompt rows as prepared: prompt, row, input_ids, the
    user's columns), each with an empty completion and with the prompt itself as one, before the run writes
    anything: a function that raises, returns the wrong length or a non-finite value is refused now, naming it,
    not at step 1."""
    if not rows:
        return
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    chat = isinstance(prompts[0], list)
    texts = [t for r in rows for t in ("", r["prompt"] if isinstance(r["prompt"], str) else "")]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    ids = [i for r in rows for i in ([], list(r["input_ids"]))]
    columns = {name: [r[stored] for r in rows for _ in range(2)] for name, stored in reward_columns(rows[0]).items()}
    for name, fn, _ in functions:
        check_arguments(name, fn, columns=list(columns), where=where)
    score(functions, prompts, completions, completion_ids=ids, columns=columns,
          rows=[r["row"] + 1 for r in rows for _ in range(2)], where=where, state=state, runner=runner)


def check_arguments(name: str, fn: RewardFn, *, columns: list[str], where: str) -> None:
    """Refuse a function whose signature asks for an argument that no call will pass (a column the data lacks),
    naming it and the columns there are, instead of Python's bare `TypeError ... missing 1 required positional
    argument`. Signatures that cannot be read (some builtins, C callables) are left to the call itself."""
    if missing := unpassed(fn, {*TRL_ARGUMENTS, *columns}):
        raise LLMTrainError(
            f"reward function {name} needs the argument '{missing[0]}', which nothing passes: a reward function is "
            f"called with keyword arguments, {', '.join(TRL_ARGUMENTS)} and each column of {where} but the prompt "
            f"(which is `prompts`) by its name: {sorted(columns) or 'none'}. Rename the data's column to "
            f"'{missing[0]}', or change the function to read one of those columns by its name (or give "
            f"'{missing[0]}' a default); llmtrain does not rename columns for reward functions.")


def unpassed(fn, given: set[str], *, skip: int = 0) -> list[str]:
    """The arguments `fn` requires that a call passing `given` by keyword leaves out (every argument goes by keyword,
    as TRL passes them: a required positional-only one can never be given); `skip`: leading ones (a method's self).
    [] where the signature cannot be read (some builtins, C callables): left to the call itself."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and (
        p.kind is inspect.Parameter.POSITIONAL_ONLY
        or p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) and p.name not in given)]


def _rows(rows: list[int]) -> str:
    shown = sorted(set(rows))
    return ", ".join(map(str, shown[:5])) + (", ..." if len(shown) > 5 else "")
