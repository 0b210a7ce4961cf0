"""The command line as people run it: subprocesses of the installed `llmtrain` script and `python -m llmtrain`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ENV, LLMTRAIN, REPO, cli, invoke, records, write_recipe

SCRIPT = Path(sys.executable).with_name("llmtrain")  # the console script installed beside this Python
TINY_RECIPE = str(REPO / "recipes" / "tiny.yaml")


pytestmark = pytest.mark.long(70)  # tests/conftest.py


def _script() -> list[str]:
    if SCRIPT.is_file():
        return [str(SCRIPT)]
    found = shutil.which("llmtrain")
    if found is None:
        pytest.skip("the llmtrain console script is not installed (pip install -e .)")
    return [found]


def _run(argv: list[str], env: dict[str, str] = ENV, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("entry", ["script", "module"])
def test_help(entry):
    argv = _script() if entry == "script" else LLMTRAIN
    proc = _run([*argv, "--help"])
    assert proc.returncode == 0, proc.stderr
    for command in ("finetune", "export", "inspect-data", "prepare-tiny"):
        assert command in proc.stdout
    assert "Traceback" not in proc.stderr


def test_command_help():
    proc = _run([*LLMTRAIN, "finetune", "--help"])
    assert proc.returncode == 0 and "--resume auto|PATH" in proc.stdout and "--overwrite" in proc.stdout


@pytest.mark.parametrize("command, usage", [
    ("finetune", "Usage: llmtrain finetune [OPTIONS] RECIPE.yaml [KEY=VALUE]..."),
    ("estimate-memory", "Usage: llmtrain estimate-memory [OPTIONS] [RECIPE.yaml] [KEY=VALUE]..."),
    ("plot", "Usage: llmtrain plot [OPTIONS] RUN..."),
])
def test_h_is_help_and_arguments_are_named_in_the_recipes_words(command, usage):
    """-h as --help, and no typer types (<path>, <list[str]>) or braces ({RECIPE.yaml}) around the arguments
    (issue 53)."""
    proc = _run([*LLMTRAIN, command, "-h"])
    assert proc.returncode == 0 and proc.stdout.startswith(usage), proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("RECIPE", "KEY", "RUN"))]
    assert rows and all(not row[1].startswith("<") for row in rows if len(row) > 1), rows  # no <path>, <list[str]>
    assert "{" not in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("command", ["finetune", "inspect-data", "export", "generate", "eval", "prepare-tiny",
                                     "estimate-memory", "doctor", "plot"])
def test_each_option_names_its_value_not_its_type(command):
    """typer writes an option's type where click names its value (--seed <int>, --top-p <float range>, --out <path>,
    --method <full|lora>; issue 53): the help names it (N, X, PATH, full|lora), every option of every command."""
    import re

    proc = _run([*LLMTRAIN, command, "-h"], env={**ENV, "COLUMNS": "200"})
    rows = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("-")]
    assert proc.returncode == 0 and rows, proc.stdout
    typed = [row for row in rows if re.match(r"^[-\w, /]+ <", row)]
    assert not typed, typed
    if command == "generate":
        assert any(row.startswith("--seed N ") for row in rows) and any(row.startswith("--out PATH ") for row in rows)
    if command == "estimate-memory":
        assert any(row.startswith("--method full|lora ") for row in rows), rows


def test_the_help_works_on_a_typer_without_its_rich_type_display(monkeypatch):
    """typer before 0.29 (0.19-0.28, which the GPU machine had) gives an option no display_type_rich: the command
    that renames the types (_Command) leaves such options as typer writes them, where it once died building every
    command (AttributeError, before any recipe was read). pyproject asks typer>=0.19: 0.16-0.18 refuse Literal
    options (--method full|lora)."""
    import typer.core
    from typer.testing import CliRunner

    from llmtrain.cli import app

    for cls in typer.core.TyperOption.__mro__:
        if "display_type_rich" in vars(cls):
            monkeypatch.delattr(cls, "display_type_rich")
    assert not hasattr(typer.core.TyperOption, "display_type_rich")
    # (typer 0.29's own help formatting calls it, so the help itself is not shown here; a command is run)
    result = CliRunner().invoke(app, ["finetune", str(REPO / "no-such-recipe.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output, result.output


def test_launch_help_names_what_it_takes():
    """`llmtrain launch --help` listed no options (issue 53): its usage names the recipe and the flags it passes on."""
    out = " ".join(_run([*LLMTRAIN, "launch", "-h"], env={**ENV, "COLUMNS": "100"}).stdout.split())
    assert out.startswith("Usage: llmtrain launch [ACCELERATE LAUNCH FLAGS] RECIPE.yaml [KEY=VALUE]... [FINETUNE "
                          "OPTIONS]"), out
    assert "--config_file PATH, --num_processes N" in out and "FINETUNE OPTIONS: --resume auto|PATH" in out


def test_version_names_llmtrain_and_the_libraries_it_trains_with():
    from importlib.metadata import version

    proc = _run([*LLMTRAIN, "--version"])
    assert proc.returncode == 0 and proc.stdout.strip() == (
        f"llmtrain {version('llmtrain')} (torch {version('torch')}, transformers {version('transformers')}, "
        f"accelerate {version('accelerate')}, peft {version('peft')})")


def test_llmtrains_own_warnings_are_one_line_and_the_libraries_are_pythons():
    """A warning llmtrain raises (the fast sampler's fall-back, from its modules) reads `warning: ...`, as the run's
    other warnings; one from a library keeps Python's file and line (it showed llmtrain's file, line and source
    line before: `.../rollouts.py:42: UserWarning: ...` and the call beneath it)."""
    import llmtrain
    from llmtrain.cli import one_line_warning

    here = str(Path(llmtrain.__file__).parent / "objectives" / "rollouts.py")
    assert one_line_warning("rl.sampler=graph: ...", UserWarning, here, 42) == "warning: rl.sampler=graph: ...\n"
    theirs = "/site-packages/peft/tuners/tuners_utils.py"
    assert one_line_warning("keys ignored", RuntimeWarning, theirs, 7).startswith(
        f"{theirs}:7: RuntimeWarning: keys ignored")


def test_cli_import_is_light():
    """`llmtrain --help` must not pay for torch/transformers: the CLI module imports neither."""
    code = ("import sys, llmtrain.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets', 'peft') if m in sys.modules))")
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_unknown_key_suggests_the_right_one():
    proc = _run([*_script(), "finetune", TINY_RECIPE, "train.learning_rate=1e-4"])
    assert proc.returncode == 2
    assert "did you mean train.lr" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_missing_recipe_is_a_clean_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = _run([*_script(), "finetune", str(missing)])
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "nope.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_launch_prints_an_error_raised_before_the_process_group_once_a_node(tmp_path):
    """Every process of a launch raises the same paragraph before the group exists: the node's first (LOCAL_RANK 0)
    prints it and exits at once; the others exit 2 without repeating it, after waiting QUIET_EXIT_DELAY_S, so that
    the launcher (which ends every process when the first one exits) cannot end the printing one before it printed.
    time.sleep is replaced to say what was waited."""
    from llmtrain.cli import QUIET_EXIT_DELAY_S

    missing = str(tmp_path / "nope.yaml")
    code_line = ("import sys, time; time.sleep = lambda s: print(f'waited {s}'); "
                 f"sys.argv = ['llmtrain', 'finetune', {missing!r}]; from llmtrain.cli import main; main()")
    first = _run([sys.executable, "-c", code_line], env={**ENV, "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    other = _run([sys.executable, "-c", code_line], env={**ENV, "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert first.returncode == other.returncode == 2
    assert "does not exist" in first.stderr and other.stderr == ""
    assert first.stdout == "" and other.stdout == f"waited {QUIET_EXIT_DELAY_S}\n"


def test_debug_shows_the_traceback(tmp_path):
    proc = _run([*_script(), "--debug", "finetune", str(tmp_path / "nope.yaml")])
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "RecipeError" in proc.stderr
    # after the command too: it had been click's bare "No such option: --debug" (audit 36)
    proc = _run([*_script(), "finetune", str(tmp_path / "nope.yaml"), "--debug"])
    assert proc.returncode != 0 and "No such option" not in proc.stderr
    assert "Traceback" in proc.stderr and "RecipeError" in proc.stderr


def test_bad_override_value_names_the_key():
    proc = _run([*LLMTRAIN, "finetune", TINY_RECIPE, "train.micro_batch_size=0", "train.lr=fast"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train.micro_batch_size" in proc.stderr and "train.lr" in proc.stderr  # every problem at once


@pytest.mark.slow
def test_finetune_end_to_end(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 10},
                          checkpoint={"every_steps": 2, "keep_last": 1})
    run = tmp_path / "out"
    proc = cli("finetune", str(recipe), f"output_dir={run}", "train.max_steps=3")
    assert "done: 3 steps" in proc.stdout
    assert [r["step"] for r in records(run)] == [1, 2, 3]
    # The resolved recipe, overrides applied, is saved with the run.
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert saved["train"]["max_steps"] == 3 and saved["output_dir"] == str(run)
    assert (run / "final" / "model.safetensors").is_file() and (run / "final" / "tokenizer.json").is_file()
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]

    # Running it again into the same folder is refused with a hint, exit 2, no traceback (the rest in this process,
    # as `llmtrain` runs them: the same exit codes and words, without a subprocess's import of torch each).
    again = invoke("finetune", str(recipe), f"output_dir={run}", check=False)
    assert again.returncode == 2 and "--resume auto" in again.stderr and "Traceback" not in again.stderr
    # --resume auto continues it from the step-2 checkpoint up to the new max_steps, once that change is
    # allowed explicitly (it changes the learning-rate curve); without the flag nothing is touched.
    refused = invoke("finetune", str(recipe), f"output_dir={run}", "train.max_steps=4", "--resume", "auto",
                     check=False)
    assert refused.returncode == 2 and "--allow-recipe-change" in refused.stderr
    proc = invoke("finetune", str(recipe), f"output_dir={run}", "train.max_steps=4", "--resume", "auto",
                  "--allow-recipe-change")
    assert "at step 2" in proc.stdout
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]


def test_a_missing_recipe_is_refused_before_torch_is_imported(tmp_path):
    """The error for a mistyped recipe path comes at once (it took 1.7 s, importing torch first)."""
    import subprocess
    import sys

    code = ("import sys, runpy\nsys.argv = ['llmtrain', 'finetune', sys.argv[1]]\n"
            "try:\n    runpy.run_module('llmtrain', run_name='__main__')\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nope.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert "exit 2 False" in proc.stdout, proc.stdout + proc.stderr
    assert "does not exist" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [[], ["finetune"], ["doctor"], ["estimate-memory"], ["export"]])
def test_help_fits_80_columns_with_whole_option_names(command):
    """In an 80-column terminal the help showed `--micro-batch-to…` and `<bool>` after on/off flags."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "llmtrain", *command, "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"}, timeout=120)
    assert proc.returncode == 0 and "…" not in proc.stdout and "<bool>" not in proc.stdout, proc.stdout
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())
    if command == ["estimate-memory"]:
        assert "--micro-batch-tokens" in proc.stdout and "--grad-checkpointing / --no-grad-checkpointing" in proc.stdout


@pytest.mark.parametrize("world_size", ["1", "2"])
@pytest.mark.parametrize("command, code", [(["--help"], 0), (["finetune", "no-such-recipe.yaml"], 2)])
def test_a_launched_process_that_succeeds_skips_teardown_and_keeps_its_output(world_size, command, code):
    """Under a multi-process launch (WORLD_SIZE > 1) a command that succeeded leaves with os._exit: the interpreter's
    teardown, where a gloo thread can abort a finished run (cli.exit_now), never runs (an atexit handler does not
    print), yet everything printed (to a pipe, so buffered) comes out. A failing command exits the usual way, with its
    code and its one-paragraph error."""
    code_line = ("import atexit, sys; atexit.register(lambda: print('teardown ran')); "
                 f"sys.argv = ['llmtrain', *{command!r}]; print('before'); "
                 "from llmtrain.cli import main; main()")
    proc = _run([sys.executable, "-c", code_line], env={**ENV, "WORLD_SIZE": world_size, "LOCAL_RANK": "0"})
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.startswith("before") and "Traceback" not in proc.stderr
    assert ("finetune" in proc.stdout) if code == 0 else ("no-such-recipe.yaml" in proc.stderr)
    assert ("teardown ran" in proc.stdout) == (world_size == "1" or code != 0)


def test_library_notes_with_nothing_for_the_user_to_do_are_not_shown(caplog):
    """Audit 58: every save of a model with a tied head printed accelerate's "Removed shared tensor ... check by
    verifying that you don't receive any warning while reloading" (llmtrain saves the tied weight once and reloads
    it), and every offline LoRA command the `kernels` package's "Skipping publisher trust check" of a repository the
    run never fetches. Both are dropped where they are logged; the same loggers' other warnings are not."""
    import logging

    import llmtrain  # noqa: F401  (its import quiets them)

    with caplog.at_level(logging.WARNING):
        logging.getLogger("accelerate.utils.other").warning(
            "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but check by verifying "
            "that you don't receive any warning while reloading")
        logging.getLogger("accelerate.utils.other").warning("another of accelerate's warnings")
        logging.getLogger("accelerate.utils.other").warning(  # another shared tensor: a reload may not tie it back
            "[RANK 0] Removed shared tensor {'model.layers.0.mlp.up_proj.weight'} while saving. This should be OK")
        logging.getLogger("kernels._internals.hf_hub").warning(
            "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face "
            "Hub is in offline mode.")
    assert [r.getMessage()[:40] for r in caplog.records] == ["another of accelerate's warnings",
                                                           "[RANK 0] Removed shared tensor {'model.l"]
