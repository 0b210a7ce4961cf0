"""Tool calling in online RL (rl.tools): completions that call Python functions mid-way, as TRL 1.16's GRPOTrainer
samples them (its _tool_call_loop).

A round samples each row to its end of turn. A turn whose text holds tool calls, as the chat template writes them
(data/tools.call_syntax: Qwen's `<tool_call>{...}</tool_call>`, Llama 3.1's JSON turn, Mistral's `[TOOL_CALLS]
[...]`), has every call run (`Tools.run`: sync or async, under rl.tool_timeout_s; an exception, an unknown name or
a time-out becomes the result `{'error': ...}`, as TRL writes it); the results are appended as the template renders
`tool` messages after the turn, up to the next generation prompt (data/tools.tool_suffix_ids), and the row samples
on from there (its prompt + everything so far prefilled again). Up to rl.max_tool_calls rounds; a row whose results
would take its completion past max_completion_tokens stops before them (TRL drops them the same way), and what a
row samples after them is cut to what is left of max_completion_tokens.

The completion is every token after the prompt; the results' tokens have mask 0 (TRL's tool_mask): they are not
trained, not in the KL, not counted in the completion's length. Each round's seed is a pure function of the
completion's seed and the round, so a completion still depends only on the run's seed, the step and its prompt
(the tools must be deterministic for a resumed run to sample the same).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any

from llmtrain.data.tools import CallSyntax, Turn, call_syntax, function_of, parse_turn, tool_suffix_ids
from llmtrain.errors import LLMTrainError
from llmtrain.model.generate import Drawn, Stops
from llmtrain.objectives.rollouts import here


@dataclass
class ToolRollout:
    """One completion with its tool calls: its tokens after the prompt, the mask of those the model wrote (1) and
    the tools' results (0), the conversation it makes (assistant turns parsed, tool messages: what reward functions
    get, as TRL hands them), each call run ({"name", "arguments", "result", "failed"}), and turns that opened calls
    no parser could read."""

    ids: list[int]
    mask: list[int]
    messages: list[dict]
    calls: list[dict] = field(default_factory=list)
    unreadable: int = 0
    # the sampler's log-probability of each token (0: a result's, and every token where it was not asked for them)
    logps: list[float] = field(default_factory=list)
    cut: bool = False  # a round's results did not fit max_completion_tokens: the row stopped for want of room
    prompt: Any = None  # the prompt with rl.environment's observation added (what it was sampled from), or None

    @property
    def failures(self) -> int:
        return sum(c["failed"] for c in self.calls)


class Tools:
    """rl.tools (and rl.environment's tool methods), imported and described: the functions by name, the template's
    call syntax, and the runner of a turn's calls. Built once a run; refused in one paragraph (a tool that cannot be
    imported or described, a template that cannot show or read back tool calls) before anything is written."""

    def __init__(self, names: list[str], *, tokenizer, template: str | None = None, timeout_s: float = 30.0,
                 runner=None, stop_ids=(), environment: str | None = None):
        from llmtrain.data.tools import environment_tools, rl_tool_schemas

        # type hints and an Args docstring for each, or a clear error; the order the prompts show them
        self.schemas = rl_tool_schemas(names, environment)
        # rl.environment's class and its tool methods' names
        self.environment, self.methods = environment_tools(environment)[:2] if environment else (None, [])
        self.functions = {}
        for name in names:
            fn = function_of(name)
            if fn.__name__ in self.functions or fn.__name__ in self.methods:
                raise LLMTrainError(f"rl.tools names two functions called '{fn.__name__}' (rl.environment's methods "
                                    "count): the model calls a tool by its function's name, so each must have its "
                                    "own.")
            self.functions[fn.__name__] = fn
        self.pool: list = []  # the environment's instances, reused (reset) rollout after rollout
        self.tokenizer, self.template, self.timeout_s = tokenizer, template, timeout_s
        self.syntax: CallSyntax = call_syntax(tokenizer, template)
        from llmtrain.data.chat import end_of_turn

        self.end_of_turn = end_of_turn(tokenizer, template)
        check_template_shows(tokenizer, template, self.schemas)
        self.stop_ids = Stops.of(stop_ids)
        self.runner = runner

    @classmethod
    def of_run(cls, rl, *, tokenizer, template: str | None, stop_ids, runner=None) -> Tools:
        """A run's tools: rl.tools and rl.environment's methods, under its rl.tool_timeout_s."""
        return cls(rl.tools, tokenizer=tokenizer, template=template, timeout_s=rl.tool_timeout_s, runner=runner,
                   stop_ids=stop_ids, environment=rl.environment)

    def names(self, per_instance: str = "") -> list[str]:
        """The tools' names as the model calls them, an environment's as Class.method (+ `per_instance`)."""
        return [*self.functions, *(f"{self.environment.__name__}.{m}{per_instance}" for m in self.methods)]

    def parse(self, ids: list[int]) -> Turn:
        """A sampled turn (its tokens, the stop token included) as text and calls."""
        ids = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.end_of_turn and self.end_of_turn in text:
            text = text[: text.index(self.end_of_turn)]
        turn = parse_turn(text, self.syntax)
        if turn.calls and self.syntax.shows_id and not self._renders(turn.calls):
            turn = Turn(text.strip(), [], unreadable=True)
        if not turn.calls:  # what the turn says, as the reward functions read a plain completion
            turn.content = self.stop_ids.reply(self.tokenizer.decode(ids, skip_special_tokens=True))
        return turn.without_reasoning()

    def _renders(self, calls: list[dict]) -> bool:
        """Whether the template renders these calls' results (Mistral's refuses a call id that is not 9 letters and
        digits, which a sampled call may lack or get wrong: its error had stopped the run mid-rollout). A turn whose
        calls it refuses is text, none run: TRL's fallback for a call it cannot read."""
        results = [{"role": "tool", "name": c["function"]["name"], "content": "",
                    **({"tool_call_id": c["id"]} if "id" in c else {})} for c in calls]
        try:
            tool_suffix_ids(self.tokenizer, self.template, results)
        except LLMTrainError:
            return False
        return True

    def environments(self, n: int) -> list:
        """n instances of rl.environment (made once, then reused: reset before each rollout), or n Nones."""
        if self.environment is None:
            return [None] * n
        while len(self.pool) < n:
            self.pool.append(self.environment())
        return self.pool[:n]

    def run(self, calls: list[dict], environment=None) -> list[dict]:
        """Each call's record {"name", "arguments", "result" (the text the model reads), "failed"}: sync tools one
        after the other, async ones together (TRL's order of results: the sync ones first); `environment`: the
        rollout's instance, whose tool methods are called on it."""
        done, waiting = [], []
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            fn = getattr(environment, name) if environment is not None and name in self.methods else \
                self.functions.get(name)
            record = {"name": name, "arguments": arguments, **({"id": call["id"]} if "id" in call else {})}
            if fn is None:
                done.append({**record, "result": str({"error": f"Tool {name} not found."}), "failed": True})
            elif inspect.iscoroutinefunction(fn):
                waiting.append((record, fn, arguments))
            else:
                try:
                    done.append({**record, "result": _text(_within(self.timeout_s, fn, arguments)), "failed": False})
                except TimeoutError:
                    done.append({**record, "result": self._late(), "failed": True})
                except Exception as e:  # the tool's own error is its result, as TRL's
                    done.append({**record, "result": str({"error": str(e)}), "failed": True})
        if waiting:
            from llmtrain.objectives.rewards import AsyncRunner

            self.runner = self.runner or AsyncRunner()

            async def bounded(fn, arguments):
                return await asyncio.wait_for(fn(**arguments), self.timeout_s)

            for (record, _, _), value in zip(waiting, self.runner.gather([bounded(f, a) for _, f, a in waiting])):
                if isinstance(value, asyncio.TimeoutError):
                    done.append({**record, "result": self._late(), "failed": True})
                elif isinstance(value, BaseException):
                    done.append({**record, "result": str({"error": str(value)}), "failed": True})
                else:
                    done.append({**record, "result": _text(value), "failed": False})
        return done

    def _late(self) -> str:
        return str({"error": f"the tool ran past rl.tool_timeout_s={self.timeout_s:g} s"})

    def suffix(self, records: list[dict]) -> tuple[list[dict], list[int]]:
        """The `tool` messages of a round's results and their tokens as the template renders them after the turn."""
        messages = [{"role": "tool", "name": r["name"], "content": r["result"],
                     **({"tool_call_id": r["id"]} if "id" in r else {})} for r in records]
        return messages, tool_suffix_ids(self.tokenizer, self.template, messages)


def check_template_shows(tokenizer, template: str | None, schemas: list[dict]) -> None:
    """Refuse a template that never shows the tools in a prompt, or leaves a tool's result out of what it renders
    after a call (TRL's GRPOTrainer refuses the second: supports_tool_calling), as the SFT side refuses them: the model
    would call tools it was never shown, or answer without their results. Probed with the first tool's schema and a
    sentinel result."""
    from llmtrain.data.chat import TOOL_RESULT_PROBE, _apply

    name = schemas[0]["function"]["name"] if "function" in schemas[0] else schemas[0]["name"]
    prompt = _apply(tokenizer, [{"role": "user", "content": "Call the tool."}], template, generation_prompt=True,
                    tools=schemas)
    if name not in prompt:
        raise LLMTrainError(f"the chat template does not show the tools in the prompt (the tool '{name}' is nowhere in "
                            "a prompt rendered with them), so the model would be asked to call tools it never sees. "
                            "Give a template that renders its tools argument (data.chat_template: "
                            "path/to/template.jinja).")
    from llmtrain.data.chat import PROBE_IDS

    suffix = tool_suffix_ids(tokenizer, template, [{"role": "tool", "name": name, "tool_call_id": PROBE_IDS[0],
                                                    "content": TOOL_RESULT_PROBE}])
    if TOOL_RESULT_PROBE not in tokenizer.decode(suffix):
        raise LLMTrainError("the chat template leaves a tool's result out of what it renders after a call (a probe "
                            "result is not in it), so the model would sample on without its tools' results. Give a "
                            "template that renders tool messages' content (data.chat_template: "
                            "path/to/template.jinja).")


def check_reset(name: str, cls: type, columns: list[str]) -> None:
    """Refuse an rl.environment whose reset asks for an argument that no call passes (a column the prompt data lacks),
    naming it and the columns there are: reset is called with prompt= and each column by its name (TRL's). It had
    been a TypeError traceback at step 1. A signature that cannot be read is left to the call."""
    from llmtrain.objectives.rewards import unpassed

    if missing := unpassed(cls.reset, {"prompt", *columns}, skip=1):
        raise LLMTrainError(f"rl.environment {name}'s reset needs the argument '{missing[0]}', which nothing passes: "
                            f"reset is called with prompt= and each column of the prompt data by its name: "
                            f"{sorted(columns) or 'none'}. Add a column '{missing[0]}' to the data, or give it a "
                            "default in reset.")


def _within(seconds: float, fn, arguments: dict):
    """fn(**arguments) on a daemon thread, its result or its exception; TimeoutError after `seconds` (the thread is
    left to finish on its own: a tool that never returns cannot hold the run, nor its exit)."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn(**arguments)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=call, name="llmtrain-tool", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["value"]


def _text(value) -> str:
    return value if isinstance(value, str) else str(value)


def observed(prompt, observation: str):
    """A prompt (text or messages) with an environment's observation added to its last message (TRL's)."""
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


def round_seed(seed: int, round_: int) -> int:
    """The seed of a completion's round after its tools' results: a pure function of its own seed and the round."""
    from llmtrain.model.generate import completion_seed

    return completion_seed(seed, round_, 0, 0)


def sample_with_tools(generate, prompts: list[list[int]], seeds: list[int], *, tools: Tools, max_new_tokens: int,
                      max_rounds: int | None, environments: list | None = None,
                      user_code=here, logps: bool = False) -> list[ToolRollout]:
    """The completions of `prompts` with their tool calls run (the module's docstring says how). `generate(prompts,
    seeds, max_new_tokens)` samples one turn of each (the recipe's sampler); `environments`: each completion's
    rl.environment instance (reset already), whose methods its calls reach; `user_code(compute)`: where a round's
    calls run (GRPO.user_code: under tensor parallelism on one process of the pair, which holds the environments,
    its records given to the other). logps: `generate` gives generate.Drawn (tokens and the sampler's log-probability
    of each), which each ToolRollout keeps (`logps`)."""
    environments = environments or [None] * len(prompts)

    def drawn(prompts_, seeds_, room: int) -> list[Drawn]:  # one turn of each, its tokens with their logps (or 0s)
        turn_ = generate(prompts_, seeds_, room)
        return [Drawn(list(d.ids), list(d.logps)) if logps else Drawn(list(d), [0.0] * len(d)) for d in turn_]

    out, turns = [], []
    for ids, turn_logps in drawn(prompts, seeds, max_new_tokens):
        turn = tools.parse(ids)
        turns.append(turn)
        out.append(ToolRollout(ids, [1] * len(ids), [turn.message()], unreadable=int(turn.unreadable),
                               logps=turn_logps))
    live, rounds = [i for i, t in enumerate(turns) if t.calls], 0
    while live and (max_rounds is None or rounds < max_rounds):
        rounds += 1
        going, room = [], []
        ran = user_code(lambda: [tools.run(turns[i].calls, environments[i]) for i in live])
        for i, records in zip(live, ran):
            out[i].calls += records
            messages, suffix = tools.suffix(records)
            if len(out[i].ids) + len(suffix) > max_new_tokens:  # TRL's: the results would not fit, the row stops
                out[i].cut = True
                continue
            out[i].messages += messages
            out[i].ids += suffix
            out[i].mask += [0] * len(suffix)
            out[i].logps += [0.0] * len(suffix)
            going.append(i)
            room.append(max_new_tokens - len(out[i].ids))
        if not going:
            break
        more = drawn([prompts[i] + out[i].ids for i in going], [round_seed(seeds[i], rounds) for i in going],
                     max(room)) if max(room) > 0 else [Drawn([], []) for _ in going]
        live = []
        for i, (ids, turn_logps), left in zip(going, more, room):
            # what is left of max_completion_tokens (a sample depends only on what precedes)
            ids = ids[:left]
            out[i].ids += ids
            out[i].mask += [1] * len(ids)
            out[i].logps += turn_logps[:left]
            if ids:
                turns[i] = tools.parse(ids)
                out[i].messages.append(turns[i].message())
                out[i].unreadable += int(turns[i].unreadable)
                if turns[i].calls:
                    live.append(i)
    return out
