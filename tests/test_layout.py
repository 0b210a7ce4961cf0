"""The package's folders are its architecture: no import circle, and no module imports a group above its own.

Read from the source with the standard library's `ast` (nothing is imported), so it holds for imports inside
functions too, which the interpreter would only meet at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmtrain"

# Bottom to top. A module may import its own group and the groups of lower layers, never a layer above, and never
# a group beside its own in the same layer (data and model stay independent of each other). A group is a folder,
# or for the modules at the top of the package the name below.
LAYERS = [
    {"schema"},
    {"data", "model"},
    {"parallel"},  # above the model and the data it parallelises: each parallelism in one room (parallel/pipeline/)
    {"objectives", "memory"},
    {"run"},
    {"loop"},
    {"commands"},
]
TOP = {
    # the recipe schema, the layout and the capability table (what each mode trains on), the errors every layer
    # raises, and whether the hub answers (asked before any layer reads it)
    "schema": {"errors", "config", "overrides", "hub", "layout", "capabilities"},
    "commands": {"cli", "doctor", "inspect_data", "launcher", "tiny", "__main__", "__init__"},  # what the CLI runs
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its file (top level, functions, TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def group(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    if len(parts) > 2 or (PACKAGE / name).is_dir():
        return name
    return next((g for g, names in TOP.items() if name in names), name)


def layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if group(module) in names)


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert circles(graph()) == []


def test_every_module_has_a_layer():
    assert [m for m in graph() if not any(group(m) in names for names in LAYERS)] == []


def test_no_module_imports_upward_or_sideways():
    wrong = [f"{m} ({group(m)}) imports {d} ({group(d)})" for m, deps in graph().items() for d in sorted(deps)
             if group(d) != group(m) and layer(d) >= layer(m)]
    assert wrong == []


def test_each_folder_says_what_lives_there():
    folders = sorted({p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE})
    assert len(folders) >= 7
    for folder in folders:
        init = folder / "__init__.py"  # also what makes setuptools package the folder (not a namespace package)
        assert init.is_file(), f"{folder} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init} needs a docstring saying what lives there and what it may import"


# Inside parallel/ (its docstring): which of the folder's own files each may import; a room (sequence/, pipeline/)
# counts as one, and every file may import its own room's files.
PARALLEL = {
    "launch": set(), "tensor": set(), "mesh": {"groups"}, "fsdp": {"mesh"}, "groups": {"sequence", "pipeline"},
    "collectives": {"mesh", "groups"}, "sequence": {"collectives"}, "pipeline": {"fsdp"},
    "accelerator": {"fsdp", "groups", "launch", "mesh"},
    "parallelize": {"fsdp", "groups", "mesh", "pipeline", "sequence", "tensor"},
}


def test_inside_parallel_each_file_imports_what_its_docstring_says():
    """parallel/__init__.py's rules of the folder's own imports (audit 51 found three its words had missed)."""
    def part(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "parallel" else None

    wrong = [f"{m} imports {d}" for m, deps in graph().items() if part(m) is not None for d in sorted(deps)
             if part(d) not in (None, part(m)) and part(d) not in PARALLEL[part(m)]]
    assert wrong == [] and set(PARALLEL) == {part(m) for m in graph() if part(m) is not None}
