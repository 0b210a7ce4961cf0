"""`key=value` overrides after a recipe: which text a value is, and where in the recipe it goes.

A key whose schema type is text only takes the text as given; every other key's value is YAML. See parse_override.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from llmtrain.errors import RecipeError


def parse_override(text: str, schema: type[BaseModel]) -> tuple[list[str], Any]:
    """`key=value` -> (the key's parts, the value). The value of a key whose schema type is text only (a string, a
    choice of strings, or either or null) is the text after the first `=`, exactly as given: `#`, `: `, `yes` or
    `007` stay text. `null` (or `~`) unsets such a key where it may be null (and is refused, with the key's
    default, where it may not: never taken as the text null); a value in quotes is unquoted ('null'
    is the text null). Every other key's value is read as YAML, so that 8 is an int, 1e-4 a float, true a bool,
    [a, b] a list and {prompt: question} a mapping."""
    if "=" not in text:
        raise RecipeError(f"Override '{text}' is not of the form key=value (for example train.lr=1e-4).")
    key, raw = text.split("=", 1)
    if not key:
        raise RecipeError(f"Override '{text}' has an empty key.")
    parts = key.split(".")
    kinds = _value_kinds(parts, schema)
    text_only = kinds is not None and kinds <= {str, type(None)}
    if raw == "":  # a script's empty $STEPS (or $OUT: output_dir= had written the run into the current folder) would
        # otherwise unset the key, or set it to the empty text
        raise RecipeError(f"Override '{text}' has no value. Give one (for example {key}="
                          f"{'runs/x' if text_only else '8'}), or {key}=null to unset the key"
                          + (f" ({key}='' for the empty text)." if text_only else "."))
    if text_only:
        if raw in ("null", "~"):
            return parts, None  # where the key may not be null, validation says so and names its default
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
        return parts, _yaml(raw, text) if quoted else raw
    return parts, _yaml(raw, text)


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader but for YAML 1.1's octal and base-60 numbers, which it read as `010` -> 8 and `1:30` -> 90
    (a seed or a step count written with a leading zero changed without a word; audit 47): such a scalar stays the
    text as written, which the schema reads as a reader means it (`010` an int field's 10) or refuses (`1:30`). A key
    written twice in one mapping is refused: PyYAML kept the last, so a second `train:` section replaced the whole
    first one without a word (audit 49)."""

    def construct_document(self, node):
        _no_key_twice(node, set())  # on the document as written, before merge keys (`<<: *base`) fill mappings in
        return super().construct_document(node)


def _no_key_twice(node, seen_nodes: set) -> None:
    """Refuse a mapping of the document that writes a key twice (its merged keys `<<` may repeat one: they are
    defaults); each node once (an alias points at a node already seen)."""
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag != "tag:yaml.org,2002:merge" and isinstance(key_node, yaml.ScalarNode):
                if key_node.value in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key '{key_node.value}' is written twice (first at line "
                        f"{lines[key_node.value] + 1}): YAML would keep the second alone, dropping the first without "
                        "a word. Keep one", key_node.start_mark)
                lines[key_node.value] = key_node.start_mark.line
            _no_key_twice(value_node, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_key_twice(item, seen_nodes)


def _as_written(base):
    def construct(loader, node):
        value = loader.construct_scalar(node)
        if ":" in value or re.fullmatch(r"[-+]?0[0-9_]+", value):
            return value
        return base(loader, node)
    return construct


RecipeLoader.add_constructor("tag:yaml.org,2002:int", _as_written(yaml.SafeLoader.construct_yaml_int))
RecipeLoader.add_constructor("tag:yaml.org,2002:float", _as_written(yaml.SafeLoader.construct_yaml_float))


def read_yaml(text: str) -> Any:
    """A recipe's (or an override's) YAML, numbers as written (RecipeLoader)."""
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader


def _yaml(raw: str, text: str) -> Any:
    """An override's value read as YAML; malformed YAML (an unclosed [ or {) is refused naming the override."""
    try:
        return read_yaml(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"Override '{text}': its value is not valid YAML ({problem}). Close its brackets and "
                          "quotes, e.g. lora.target_modules=[q_proj,v_proj] or data.fields={prompt: question}; quote "
                          "the whole override in the shell.") from None


def _value_kinds(parts: list[str], schema: type[BaseModel]) -> set[type] | None:
    """The Python types a dotted key of the schema takes (Literal choices of strings count as str); None for a key
    the schema does not know (validation then names it)."""
    model: Any = schema
    annotation = None
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if part.isdigit() and typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]  # an item of a list such as rl.rewards: rl.rewards.1.name
        elif fields is not None and part in fields:
            annotation = fields[part].annotation
        elif typing.get_origin(annotation) is dict and i == len(parts) - 1:
            annotation = typing.get_args(annotation)[1]  # a value inside a mapping such as data.fields
        else:
            return None
        model = next((a for a in (annotation, *typing.get_args(annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
    kinds: set[type] = set()
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for a in typing.get_args(annotation) if union else (annotation,):
        if typing.get_origin(a) is typing.Literal:
            kinds |= {type(choice) for choice in typing.get_args(a)}
        else:
            kinds.add(typing.get_origin(a) or a)
    return kinds


def apply_overrides(data: dict, overrides: list[str], schema: type[BaseModel]) -> dict:
    """Set each `key=value` of `overrides` in the recipe mapping `data`, reading values by `schema`'s types (the
    recipe schema, config.Recipe: passed in, so this module never imports the schema that imports it)."""
    for text in overrides:
        path, value = parse_override(text, schema)
        node = data
        for k, part in enumerate(path[:-1]):
            if isinstance(node, list):  # rl.rewards.1.name: the list's item 1 (0-based, as Python and YAML count)
                child = _item(node, part, text, ".".join(path[:k]))
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
            if not isinstance(child, (dict, list)):
                raise RecipeError(f"Override '{text}': '{part}' is a value, not a section.")
            node = child
        if isinstance(node, list):
            node[_index(node, path[-1], text, ".".join(path[:-1]))] = value
        else:
            node[path[-1]] = value
    return data


def _index(items: list, part: str, text: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise RecipeError(f"Override '{text}': {where} is a list of {len(items)} item(s), so its items are "
                          f"{where}.0 to {where}.{len(items) - 1}; '{part}' is not one of them.")
    return int(part)


def _item(items: list, part: str, text: str, where: str):
    return items[_index(items, part, text, where)]
