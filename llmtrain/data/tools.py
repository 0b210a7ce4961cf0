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
import json
from typing import Any

from llmtrain.errors import LLMTrainError


def is_tool_chat(messages: list[dict], tools: Any) -> bool:
    """Whether a chat needs the tool path: tools given, a tool call made, or a tool's result in it."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


@functools.lru_cache(maxsize=256)
def _schema_of(name: str) -> dict:
    """The JSON schema of the function `module:function`, as transformers makes it (TRL's contract: type hints and a
    docstring with an Args section)."""
    from transformers.utils import get_json_schema

    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise LLMTrainError(f"the tool '{name}' cannot be imported ({e}). Name it as module:function, with the module "
                            "on the Python path (PYTHONPATH), or give its JSON schema instead.") from None
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
            out.append(_schema_of(tool))
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
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise LLMTrainError(f"{where}: the arguments of the call to '{fn['name']}' are not JSON "
                                f"({e.msg}).") from None
    if not isinstance(arguments, dict):
        raise LLMTrainError(f"{where}: the arguments of the call to '{fn['name']}' are a "
                            f"{type(arguments).__name__}, not an object of named arguments.")
    out = {k: v for k, v in call.items() if k != "function"} if "function" in call else {}
    return {**out, "type": "function", "function": {**fn, "arguments": arguments}}


def tool_messages(messages: list[dict], where: str) -> list[dict]:
    """The chat with each assistant's tool calls in the templates' shape (and an empty content where it has none);
    keys a dataset filled with null for messages without them are left out."""
    out = []
    for k, m in enumerate(messages):
        m = {key: v for key, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [_call(c, f"{where}, message {k + 1}") for c in m["tool_calls"]]
        else:
            m.pop("tool_calls", None)
        m.setdefault("content", "")
        out.append(m)
    return out
