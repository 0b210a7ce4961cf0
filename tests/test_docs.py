"""Every command the README and docs/ show still parses: the CLI accepts its options, the recipe it names exists
and validates with its overrides, and an `accelerate launch` names a launch config of this repository and options
accelerate knows. (Nothing is run: the commands are parsed the way `llmtrain` and `accelerate launch` parse them.)
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
STARTS = ("llmtrain ", "accelerate launch ")


def shown_commands(text: str) -> list[tuple[str, str]]:
    """The commands in a page's code (fenced or indented lines that start with `llmtrain` or `accelerate launch`),
    with their backslash continuations joined, each with the error the page shows under it ("" for none)."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith(STARTS):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            shown = lines[i + 1].strip() if i + 1 < len(lines) else ""
            out.append((line, shown.removeprefix("# error:").strip() if shown.startswith("# error:") else ""))
        i += 1
    return out


COMMANDS = [(page.relative_to(REPO).as_posix(), *c) for page in PAGES for c in shown_commands(page.read_text())]


def test_the_pages_show_commands():
    pages = {page for page, _, _ in COMMANDS}
    assert {"README.md", "docs/launch.md", "docs/recipes.md", "docs/memory.md", "docs/scaling.md"} <= pages
    assert len(COMMANDS) >= 30


def test_a_wrong_command_is_caught(tmp_path):
    """The check below can fail: a renamed option, an unknown recipe key and a missing launch config are caught."""
    with pytest.raises(Exception):
        check_llmtrain(["finetune", "recipes/tiny.yaml", "--no-such-option"])
    with pytest.raises(Exception):
        check_llmtrain(["finetune", "recipes/tiny.yaml", "train.learning_rate=1e-4"])
    with pytest.raises(AssertionError):
        check_command("accelerate launch --config_file accelerate_configs/nope.yaml -m llmtrain finetune "
                      "recipes/tiny.yaml")
    with pytest.raises(Exception):
        check_command("llmtrain launch --config_file accelerate_configs/nope.yaml recipes/tiny.yaml")
    with pytest.raises(Exception):
        check_command("llmtrain launch --config_file accelerate_configs/fsdp.yaml recipes/tiny.yaml train.lr_=1")


def check_llmtrain(args: list[str]) -> None:
    import typer

    from llmtrain.cli import app
    from llmtrain.config import load_recipe

    root = typer.main.get_command(app)
    ctx = root.make_context("llmtrain", list(args), resilient_parsing=False)
    name, *rest = [*getattr(ctx, "_protected_args", []), *ctx.args]  # what follows the root's own options
    command = root.get_command(ctx, name)
    assert command is not None, f"no command {name!r}"
    sub = command.make_context(name, rest, parent=ctx)
    params = sub.params
    if isinstance(params.get("recipe"), Path):
        recipe = params["recipe"]
        assert (REPO / recipe).is_file(), f"{recipe} does not exist"
        load_recipe(REPO / recipe, list(params.get("overrides") or []))


def check_command(command: str) -> None:
    words = [w for w in shlex.split(command, comments=True)]
    if words[:2] == ["llmtrain", "launch"]:  # its own checks: the launch config, the recipe, the overrides
        from llmtrain.launcher import accelerate_command

        launch = accelerate_command(words[2:], machine=False)  # not this CPU machine's GPUs and cache
        assert launch[launch.index("--config_file") + 1] and (REPO / launch[launch.index("--config_file") + 1]
                                                                 ).is_file(), f"no launch config in {command}"
        return
    if words[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        i = words.index("-m")
        assert words[i + 1] == "llmtrain", command
        launch = launch_command_parser().parse_args([*words[2:i], "-m", "llmtrain"])
        assert launch.config_file and (REPO / launch.config_file).is_file(), f"no launch config in {command}"
        words = ["llmtrain", *words[i + 2:]]
    check_llmtrain(words[1:])


@pytest.mark.parametrize("page,command,error", COMMANDS, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(COMMANDS)])
def test_a_command_shown_in_the_docs_parses(page, command, error, monkeypatch):
    """A command the page shows failing fails with the error it shows."""
    from llmtrain.errors import RecipeError

    monkeypatch.chdir(REPO)
    command = re.sub(r"\$\{?\w+\}?", "0", command)  # $NODE_RANK, $MASTER_ADDR: any value parses
    if error:
        with pytest.raises(RecipeError) as e:
            check_command(command)
        assert error.split(" '")[0] in str(e.value)
    else:
        check_command(command)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert missing == []


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme] == []


def _changes_a_tiny_demo_run(command: str) -> bool:
    """A training command on a tiny recipe (the ones `make demo*` runs) whose key=value overrides change the run but
    keep the recipe's output_dir, without --overwrite or --resume: after the demo it stops on the demo's folder."""
    words = shlex.split(command, comments=True)
    if not ("finetune" in words or words[:2] == ["llmtrain", "launch"]):
        return False
    recipe = next((w for w in words if w.startswith("recipes/tiny")), None)
    overrides = [w for w in words if "=" in w and not w.startswith("-")]
    return bool(recipe and overrides and not any(w.startswith("output_dir=") for w in overrides)
                and not any(w.startswith(("--overwrite", "--resume")) for w in words))


def test_a_tiny_command_that_changes_the_run_names_its_own_output_dir():
    """docs/pipeline-parallel.md's first command had no output_dir: after `make demo` it stopped on runs/tiny."""
    assert _changes_a_tiny_demo_run("llmtrain finetune recipes/tiny.yaml parallel.pipeline_parallel=2")
    assert not _changes_a_tiny_demo_run("llmtrain finetune recipes/tiny.yaml train.lr=1 output_dir=runs/x")
    assert [(page, command) for page, command, error in COMMANDS
            if not error and _changes_a_tiny_demo_run(command)] == []
