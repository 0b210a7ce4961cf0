"""Tool-use conversations (TRL's conversational format with tools): a row's `tools` column, the tool calls of its
assistant messages and its `tool` messages, made ready for the model's chat template.

- `tools`: a list of JSON schemas (as transformers' `get_json_schema` writes them), or of Python functions named
  `module:function` (type hints and a Google-style docstring: turned into schemas by transformers, as TRL does), or
  a JSON string of either (as TRL reads it).
- An assistant message's `tool_calls`: [{"type": "function", "function": {"name": ..., "arguments": {...}}}] (or
  each call's {"name", "arguments"} directly); `arguments` a dict or a JSON string of one. Its `content` may be empty.
- A `tool` message: the tool's result as its content (masked out of the loss, as the user's text is).

What trains is chat.render_tool_chat's: each assistant turn as the template renders it, its tool calls included.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.data.chat import PROBE_IDS
from llmtrain.errors import LLMTrainError


def is_tool_chat(messages: list[dict], tools: Any) -> bool:
    """Whether a chat needs the tool path: tools given, a tool call made, or a tool's result in it."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def calls_only(message: Any, content_key: str = "content") -> bool:
    """An assistant turn that only calls tools (its content null, absent or blank): a message, and an answer of its
    own (a preference pair's "chosen calls the right tool, rejected the wrong one")."""
    if not isinstance(message, dict) or not message.get("tool_calls"):
        return False
    content = message.get(content_key)
    return content is None or isinstance(content, str) and not content.strip()


@functools.lru_cache(maxsize=256)
def schema_of(name: str) -> dict:
    """The JSON schema of the function `module:function`, as transformers makes it (TRL's contract: type hints and a
    docstring with an Args section)."""
    from transformers.utils import get_json_schema

    fn = function_of(name)
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
        raise LLMTrainError(f"the tool '{name}' cannot be described to the model: {e}. A tool needs type hints on "
                            "every argument and a docstring whose Args section describes each one (transformers' "
                            "get_json_schema; TRL's contract).") from None


def tool_schemas(value: Any, where: str) -> list[dict] | None:
    """The row's tools as JSON schemas (None where the row has none); `where` names the row for the errors."""
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise LLMTrainError(f"{where}: 'tools' is a string that is not JSON ({e.msg}, at character {e.pos}). "
                                "Give a list of JSON schemas, or of module:function names.") from None
    if not isinstance(value, list):
        raise LLMTrainError(f"{where}: 'tools' is a {type(value).__name__}; give a list of JSON schemas (or of "
                            "module:function names).")
    out = []
    for k, tool in enumerate(value):
        if isinstance(tool, str) and ":" in tool:
            out.append(schema_of(tool))
        elif isinstance(tool, dict) and ("function" in tool or "name" in tool):
            out.append(tool)
        else:
            raise LLMTrainError(f"{where}: tool {k + 1} is {str(tool)[:60]!r}: give a JSON schema ({{\"type\": "
                                "\"function\", \"function\": {\"name\": ..., \"parameters\": ...}}) or a "
                                "module:function name.")
    return out


def _call(call: Any, where: str) -> dict:
    """One tool call as templates read it: {"type": "function", "function": {"name", "arguments": dict}}."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise LLMTrainError(f"{where}: a tool call is {str(call)[:80]!r}; give {{\"type\": \"function\", "
                            "\"function\": {\"name\": ..., \"arguments\": {...}}}.")
    if fn.get("arguments") is None and (other := [k for k, v in fn.items() if v is not None and k not in (
            "name", "description", "id", "type", "index")]):  # (a call's own keys, where it is the function alone)
        # (a call with no arguments is {"name"} alone; `parameters`, Llama 3.1's own key, or a misspelt `args` had
        # been trained as "arguments": {} with the stray key beside it)
        raise LLMTrainError(f"{where}: the call to '{fn['name']}' has no 'arguments' but {', '.join(map(repr, other))}"
                            ": give its arguments under 'arguments' (an object, or a JSON string of one), as the "
                            "chat templates read them.")
    arguments = {} if fn.get("arguments") is None else fn["arguments"]  # (null: a dataset's fill for none)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise LLMTrainError(f"{where}: the arguments of the call to '{fn['name']}' are not JSON "
                                f"({e.msg}).") from None
    if not isinstance(arguments, dict):
        raise LLMTrainError(f"{where}: the arguments of the call to '{fn['name']}' are a "
                            f"{type(arguments).__name__}, not an object of named arguments.")
    if "function" in call:
        out = {k: v for k, v in call.items() if k != "function" and v is not None}
    else:  # the function's object alone: its id (Mistral's template reads it) beside the function rebuilt
        out = {k: v for k, v in call.items() if k not in ("name", "arguments", "type") and v is not None}
        fn = {"name": fn["name"]}
    return {**out, "type": "function", "function": {**fn, "arguments": arguments}}


def tool_messages(messages: list[dict], where: str, tools: list[dict] | None = None) -> list[dict]:
    """The chat with each assistant's tool calls in the templates' shape (and an empty content where it has none);
    keys a dataset filled with null for messages without them are left out. Refused where the conversation cannot
    be meant (TRL trains them all): a call to a tool the row's `tools` does not define, a tool result that follows
    no assistant turn (a user's message before it) or names a tool_call_id the calls before it do not have, an
    assistant turn with neither text nor calls (`tool_calls: []`, calls stripped: it would train its end of turn
    alone). A turn that writes its calls as text (Hermes' `<tool_call>` in the content) is answered as any other."""
    out, defined = [], {tool_name(t) for t in tools or []} - {None}
    asked = None  # the last message before the tool results: the assistant turn they answer, or what stands there
    for k, m in enumerate(messages):
        at = f"{where}, message {k + 1}" if where else f"message {k + 1}"
        m = {key: v for key, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [_call(c, at) for c in m["tool_calls"]]
            unknown = [c["function"]["name"] for c in m["tool_calls"] if c["function"]["name"] not in defined]
            if defined and unknown:
                raise LLMTrainError(f"{at}: a call to '{unknown[0]}', which the row's tools do not define (they "
                                    f"define {', '.join(sorted(defined))}): the model would learn to call a tool it "
                                    "is never shown. Add its schema to the row's tools, or fix the name.")
        elif m.get("role") == "assistant" and "tool_calls" in m and not any(
                str(m.get(k) or "").strip() for k in ("content", "reasoning_content", "thinking")):
            raise LLMTrainError(f"{at}: an assistant turn with no text and no tool calls (tool_calls is empty), "
                                "which would train its end of turn alone, as if the model stopped there. Restore "
                                "the turn's calls, or remove the turn and the tool messages that answer it.")
        else:
            m.pop("tool_calls", None)
        if m.get("role") != "tool":
            asked = m
        elif asked is None or asked.get("role") != "assistant":
            before = "the start of the chat" if asked is None else f"a {asked.get('role')} message"
            raise LLMTrainError(f"{at}: a tool result that answers no call (it follows {before}, not an assistant "
                                "turn that calls a tool): give the assistant turn with its calls before it, or "
                                "remove it.")
        elif m.get("tool_call_id") and isinstance(m["tool_call_id"], str) and (
                ids := {c["id"] for c in asked.get("tool_calls", []) if c.get("id") and isinstance(c["id"], str)}) \
                and m["tool_call_id"] not in ids:  # (an empty id is none: ids on one side only are not compared)
            raise LLMTrainError(f"{at}: a tool result for tool_call_id {m['tool_call_id']!r}, which no call of the "
                                f"assistant turn before it has (its calls' ids: {', '.join(sorted(ids))}).")
        m.setdefault("content", "")
        out.append(m)
    return out


def tool_name(schema: dict) -> str | None:
    """A tool schema's function name ({"type": "function", "function": {"name"}} or {"name"} directly)."""
    fn = schema.get("function", schema)
    return fn.get("name") if isinstance(fn, dict) else None


# --------------------------------------------------------------------------- tool calls in sampled text (online RL)

def prompt_tools(recipe) -> list[dict] | None:
    """The JSON schemas online RL's prompts are rendered with: rl.tools', then rl.environment's tool methods' (None
    without either)."""
    rl = getattr(recipe, "rl", None)
    if rl is None or not (rl.tools or rl.environment):
        return None
    return rl_tool_schemas(rl.tools, rl.environment)


def rl_tool_schemas(names: list[str], environment: str | None) -> list[dict]:
    """The schemas of the functions `names` (rl.tools), then of the tool methods of `environment` (rl.environment,
    checked first), in the order the prompts show them."""
    methods = environment_tools(environment)[2] if environment else []
    return [schema_of(name) for name in names] + methods


@functools.lru_cache(maxsize=16)
def environment_tools(name: str) -> tuple[type, list[str], list[dict]]:
    """rl.environment's class `module:Class` (TRL's environment_factory: `reset`, tool methods, optionally
    `get_reward`), its tool methods' names (the public ones but reset and get_reward) and their schemas (described
    from one instance's bound methods, as TRL probes one): one probe a process (data preparation and the objective
    both ask). Refused in one paragraph where it is not such a class."""
    from transformers.utils import get_json_schema

    cls = function_of(name, what="rl.environment", form="module:Class")
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        raise LLMTrainError(f"rl.environment '{name}' is not a class with a reset method: give module:Class, whose "
                            "instances have reset(**row) (called before each rollout, with the row's columns; it may "
                            "return text appended to the prompt), tool methods (type hints and an Args docstring) "
                            "and optionally get_reward() (TRL's environment_factory).")
    try:
        probe = cls()
    except Exception as e:
        raise LLMTrainError(f"rl.environment '{name}' cannot be made without arguments ({e}): one instance is made "
                            "per rollout, as TRL's environment_factory makes them.") from None
    methods = [m for m, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
               if m not in ("reset", "get_reward") and not m.startswith("_")]
    if not methods:
        raise LLMTrainError(f"rl.environment '{name}' has no public method but reset and get_reward: its methods are "
                            "the tools the model calls.")
    schemas = []
    for m in methods:
        try:
            schemas.append(get_json_schema(getattr(probe, m)))
        except Exception as e:
            raise LLMTrainError(f"the tool {name}.{m} cannot be described to the model: {e}. A tool needs type hints "
                                "on every argument and a docstring whose Args section describes each one.") from None
    return cls, methods, schemas


def user_module(name: str):
    """Import the user's module `name` (reward functions, tools, environments) as `python -m llmtrain` and a script
    would find it: from PYTHONPATH or the working directory. The `llmtrain` command, a console script, has its bin
    folder on sys.path instead of the working directory, so a module beside the recipe was not found; the working
    directory goes last, so that a file of the user's never shadows an installed package."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    return importlib.import_module(name)


def file_named(spec: str, what: str) -> str | None:
    """The error for `module:attr` whose module is a file's path (`rewards.py:accuracy`, `./rewards.py:accuracy`),
    which no import reads (it had been "put the module in the working directory", where it already was), or None."""
    module, _, attr = spec.partition(":")
    if not (module.endswith(".py") or "/" in module or "\\" in module):
        return None
    path = Path(module)
    folder = "the working directory" if str(path.parent) in (".", "") else f"{path.parent} on PYTHONPATH"
    return (f"{what} '{spec}' names a file; name its module instead: '{path.name.removesuffix('.py')}:{attr}', with "
            f"{folder} (a module is found on PYTHONPATH or in the working directory).")


def function_of(name: str, *, what: str = "the tool", form: str = "module:function"):
    """The Python callable `module:function` (a tool; `what` and `form` name another: rl.environment's module:Class),
    or a clear error."""
    module, _, attr = name.partition(":")
    if problem := file_named(name, what):
        raise LLMTrainError(problem)
    try:
        found = user_module(module)
    except (ImportError, ValueError) as e:
        if not module_failed(module, e):
            raise LLMTrainError(f"{what} '{name}' cannot be imported ({e}). Name it as {form}, with the module on "
                                "the Python path (PYTHONPATH) or in the working directory.") from None
        raise LLMTrainError(f"{what} '{name}' cannot be imported: {import_failure(module, e)}") from None
    except Exception as e:  # the module's own error while importing (a syntax error, a missing key it reads)
        raise LLMTrainError(f"{what} '{name}' cannot be imported: {import_failure(module, e)}") from None
    if not hasattr(found, attr):
        raise LLMTrainError(f"{what} '{name}' cannot be imported (module '{module}' has no attribute '{attr}'). Name "
                            f"it as {form}, with the module on the Python path (PYTHONPATH) or in the working "
                            "directory.")
    return getattr(found, attr)


def module_failed(module: str, e: BaseException) -> bool:
    """Whether importing the user's `module` raised `e` from inside it (it was found), rather than not finding it."""
    return not (isinstance(e, ValueError) or (isinstance(e, ModuleNotFoundError)
                                              and module.startswith(e.name or "\0")))


def import_failure(module: str, e: BaseException) -> str:
    """What to say of importing the user's `module` (reward functions, tools, environments) that raised `e`."""
    fix = (f"The module was found; fix the error in it (python -c 'import {module}' shows its traceback)."
           if module_failed(module, e) else "Put the module on PYTHONPATH or in the working directory.")
    return f"importing {module} failed: {type(e).__name__}: {e}. {fix}"


PROBE_ARGS = {"probe_argument": "probe value"}


@dataclass(frozen=True)
class CallSyntax:
    """How the chat template writes a turn's tool calls, read off the template itself (`call_syntax`): the text that
    opens the calls (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`, '' for Llama 3.1, whose whole turn is the call's
    JSON), the keys of a call's name and arguments (`arguments`, or Llama's `parameters`), and whether the template
    shows a call's id (Mistral's; the tool message then names it)."""

    opener: str
    name_key: str
    arguments_key: str
    shows_id: bool
    closer: str = ""  # what closes a call after its JSON (Qwen's `</tool_call>`; '' where the JSON ends it)


@dataclass
class Turn:
    """One sampled assistant turn, parsed: its text before the calls, its calls ({"type": "function", "function":
    {"name", "arguments"}} plus "id" where the model wrote one), and whether it opened calls it did not write
    readably (then it counts as text: its calls are not run, as TRL treats a malformed call)."""

    content: str
    calls: list[dict]
    unreadable: bool = False
    reasoning: str | None = None  # a reasoning block's text (Qwen3's <think>...</think>), apart from the content

    def message(self) -> dict:
        return {"role": "assistant", "content": self.content,
                **({"reasoning_content": self.reasoning} if self.reasoning else {}),
                **({"tool_calls": self.calls} if self.calls else {})}

    def without_reasoning(self) -> Turn:
        """The turn with a leading reasoning block moved out of its content, as TRL's response parser moves it into
        reasoning_content (Qwen3 with tools: reward functions had got '<think>...</think>The answer is 5.' where
        TRL's get 'The answer is 5.'); an empty block is dropped."""
        from llmtrain.data.chat import THINK_END

        if THINK_END not in self.content:
            return self
        before, _, after = self.content.partition(THINK_END)
        thought = before.split("<think>", 1)[-1].strip()
        return Turn(after.strip(), self.calls, self.unreadable, thought or None)


def call_syntax(tokenizer, template: str | None = None) -> CallSyntax:
    """The template's CallSyntax, found by rendering a turn with two probe calls (one where the template allows only
    one: Llama 3.1's) and locating the calls' JSON in it. Refused in one paragraph for a template that does not show
    tool calls in a form that can be read back."""
    from llmtrain.data.chat import _apply, end_of_turn

    schema = {"type": "function", "function": {"name": "probe_tool_one", "description": "A probe.", "parameters": {
        "type": "object", "properties": {"probe_argument": {"type": "string", "description": "a text"}}}}}
    calls = [{"type": "function", "id": i, "function": {"name": n, "arguments": dict(PROBE_ARGS)}}
             for i, n in zip(PROBE_IDS, ("probe_tool_one", "probe_tool_two"))]
    user = {"role": "user", "content": "Call the probe."}
    prompt = _apply(tokenizer, [user], template, generation_prompt=True, tools=[schema])
    shown = None
    for some in (calls, calls[:1]):
        try:
            text = _apply(tokenizer, [user, {"role": "assistant", "content": "", "tool_calls": some}], template,
                          generation_prompt=False, tools=[schema])
        except LLMTrainError:
            continue
        eot = end_of_turn(tokenizer, template)
        end = text.find(eot, len(prompt)) if eot else -1
        if text.startswith(prompt) and end >= 0:
            shown = text[len(prompt):end]
            break
    found = _json_objects(shown or "")
    first = next(((start, obj) for start, _, obj in found if "probe_tool_one" in obj.values()), None)
    if first is None:
        raise LLMTrainError("the chat template does not write tool calls as JSON after its generation prompt (or not "
                            "at all), so the calls a model samples cannot be read back to run its tools. Use a model "
                            "whose template renders tool calls (Qwen2.5, Qwen3, Llama 3.1, Mistral-7B-Instruct-v0.3), "
                            "or give one with data.chat_template: path/to/template.jinja.")
    start, obj = first
    name_key = next(k for k, v in obj.items() if v == "probe_tool_one")
    arguments_key = next((k for k, v in obj.items() if v == PROBE_ARGS or v == json.dumps(PROBE_ARGS)), None)
    if arguments_key is None:
        raise LLMTrainError(f"the chat template writes a tool call as {json.dumps(obj)[:120]}, without its arguments "
                            "as an object, so sampled calls cannot be read back. Give a template that does "
                            "(data.chat_template: path/to/template.jinja).")
    # the last word before the calls (Qwen3's reasoning block before it is the model's to write or not); a JSON
    # list's bracket (Mistral's) is read with the list
    words = shown[:start].rstrip().removesuffix("[").split()
    opener = words[-1] if words else ""
    # what follows the first call's JSON (its list's, Mistral's) up to the next call's opener or the turn's end
    after = shown[next(e for s_, e, o in found if o is obj):]
    closer = (after[:after.find(opener)] if opener and opener in after else after).strip()
    return CallSyntax(opener=opener, name_key=name_key, arguments_key=arguments_key,
                      shows_id=PROBE_IDS[0] in obj.values(), closer=closer)


def _json_objects(text: str, start: int = 0) -> list[tuple[int, int, dict]]:
    """Every JSON object (or list of objects) that starts at a '{' or '[' of `text` from `start` on, in order, not
    nested in an earlier one: (start, end, object)."""
    decoder, out, i = json.JSONDecoder(), [], start
    while True:
        i = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if i < 0:
            return out
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                out.append((i, end, item))
        i = end


def parse_turn(text: str, syntax: CallSyntax) -> Turn:
    """A sampled turn's text (special tokens kept, its end of turn cut off) as a Turn: its calls, each a JSON object
    with the name and arguments keys (arguments an object, or a JSON string of one), in blocks of the template's
    opener, JSON and closer that end the turn, as TRL reads them (Qwen's `<tool_call>{...}</tool_call>` blocks;
    Llama 3.1's turn that is one JSON object). A JSON object in text after the calls (a call the model only mentions)
    had been run as a call, and Llama's two objects as two calls; such a turn is text."""
    if syntax.opener:
        at = text.find(syntax.opener)
        if at < 0:
            return Turn(text.strip(), [])
        content = text[:at].strip()
    else:  # Llama 3.1: the turn is a call when it is one JSON object
        content, text, at = "", text.strip(), 0
        if not text.startswith("{"):
            return Turn(text, [])
    values = _call_blocks(text, at, syntax)
    calls = [c for c in map(lambda v: _sampled_call(v, syntax), values or []) if c is not None]
    if not calls:
        return Turn(text.strip(), [], unreadable=True)
    return Turn(content, calls, unreadable=len(calls) < len(values))


def _call_blocks(text: str, at: int, syntax: CallSyntax) -> list | None:
    """The JSON values of the call blocks from `at` to the end of `text` (opener, JSON, closer, again; whitespace
    between), each list's items one by one; None where anything else stands among or after them."""
    decoder, values, i = json.JSONDecoder(), [], at
    while True:
        if syntax.opener:
            if not text.startswith(syntax.opener, i):
                return None
            i += len(syntax.opener)
        try:
            value, i = decoder.raw_decode(text, _after_space(text, i))
        except json.JSONDecodeError:
            return None
        values += value if isinstance(value, list) else [value]
        i = _after_space(text, i)
        if syntax.closer:
            if not text.startswith(syntax.closer, i):
                return None
            i = _after_space(text, i + len(syntax.closer))
        if i >= len(text):
            return values
        if not syntax.opener:  # Llama 3.1 writes one call a turn
            return None


def _after_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _sampled_call(obj, syntax: CallSyntax) -> dict | None:
    if not isinstance(obj, dict):
        return None
    name, arguments = obj.get(syntax.name_key), obj.get(syntax.arguments_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    ident = obj.get("id") if syntax.shows_id and isinstance(obj.get("id"), str) else None
    return {"type": "function", **({"id": ident} if ident else {}), "function": {"name": name, "arguments": arguments}}


def tool_suffix_ids(tokenizer, template: str | None, messages: list[dict]) -> list[int]:
    """The tokens the template writes after an assistant turn's end of turn for these `tool` messages, up to the next
    assistant turn's generation prompt: TRL's _get_tool_suffix_ids (a dummy call rendered with and without the
    results; the text before the call's end of turn cut off)."""
    from llmtrain.data.chat import _apply, end_of_turn

    call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
    if messages[0].get("tool_call_id"):
        call["id"] = messages[0]["tool_call_id"]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = _apply(tokenizer, dummy, template, generation_prompt=False)
    full = _apply(tokenizer, dummy + messages, template, generation_prompt=True)
    eot = end_of_turn(tokenizer, template)
    # after the call's end of turn: the end of turn as often in `full` as in `before` (Qwen3 renders the last
    # assistant turn with a reasoning block and the same turn in the history without one: the texts differ before it)
    ends, at = before.count(eot) if eot else 0, -1
    for _ in range(ends):
        at = full.find(eot, at + 1)
    if not ends or at < 0 or not full[at + len(eot):].strip():
        raise LLMTrainError("the chat template renders no tool result after an assistant turn that calls a tool, so "
                            "the result cannot be appended to a sampled turn. Give a template that renders tool "
                            "messages (data.chat_template: path/to/template.jinja).")
    start = at + len(eot)
    return tokenizer(full[start:], add_special_tokens=False)["input_ids"]
