"""`llmtrain launch`: check the recipe and the launch config on this machine, then start `accelerate launch`.

`accelerate launch ... -m llmtrain finetune RECIPE` checks the same things, but only once its processes run: a
refusal is then followed by torchrun's report of the failed processes and exits 1. `llmtrain launch` takes the same
arguments as `accelerate launch` (its flags, then the recipe and its overrides) and refuses before any process starts,
with one paragraph and exit status 2; when everything passes it becomes that `accelerate launch` (exec), so its
exit status and signals are the run's. A process that stops once running (a refusal only the run can make, an error)
has said why in its own words; torchrun's report of the failed processes (a traceback of its own ChildFailedError,
40 lines) is then one line naming the processes and their exit status (`launched`; accelerate's --debug keeps it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from llmtrain.errors import LLMTrainError

LAUNCHED = "LLMTRAIN_LAUNCH"  # set for the processes llmtrain launch starts (no word on torchrun's report)
FINETUNE_OPTIONS = {"--resume": 1, "--overwrite": 0, "--allow-recipe-change": 0}  # finetune's own, with arity
# How long torchrun lets the processes finish a stop (the step, an eval, the checkpoint) after it passed them a SIGTERM
# or Ctrl-C, before it kills them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, where unset): torchrun's own 30 s had killed a
# 2-process run in its eval before the checkpoint the stop promised (audit 54); examples/slurm/llmtrain.sbatch: 280.
STOP_GRACE_S = 300


def split_finetune_options(args: list[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, finetune's options) from what follows the recipe on the command line."""
    overrides, options, i = [], [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in FINETUNE_OPTIONS:
            arity = 0 if "=" in args[i] else FINETUNE_OPTIONS[name]
            if arity and (i + arity >= len(args) or args[i + 1].startswith("--")):
                raise LLMTrainError(f"{name} needs a value after it: {name} auto (the newest checkpoint) or {name} "
                                    "<checkpoint folder>.")
            options += args[i:i + 1 + arity]
            i += 1 + arity
        elif name.startswith("--"):  # (else read as an override, "not of the form key=value")
            raise LLMTrainError(f"'{args[i]}' after the recipe is not an option of finetune's ("
                                f"{', '.join(FINETUNE_OPTIONS)}): accelerate launch's flags go before the recipe, e.g. "
                                "llmtrain launch --num_processes 2 --config_file C.yaml RECIPE.yaml key=value.")
        else:
            overrides.append(args[i])
            i += 1
    return overrides, options


def _resume_path(options: list[str]) -> str | None:
    """--resume's checkpoint folder among finetune's options (None: none, or auto)."""
    for i, option in enumerate(options):
        value = option.split("=", 1)[1] if option.startswith("--resume=") else \
            options[i + 1] if option == "--resume" and i + 1 < len(options) else None
        if value is not None:
            return None if value == "auto" else value
    return None


def check_model_files(recipe):
    """The model's config and tokenizer, read as every process will read them (a local folder, or the hub's cache
    when the hub does not answer, said in one line), a local folder's weights file, and distillation's teacher
    (teacher.teacher_problem): a missing one is said once, here, instead of by each process (under FSDP the main
    process alone reads the weights). Returns the model's config."""
    from llmtrain import hub
    from llmtrain.model.modeling import load_model_config, load_tokenizer, weights_problem

    if line := hub.fall_back(hub.recipe_hub_ids(recipe)):
        print(line, file=sys.stderr)
    config = load_model_config(recipe.model)
    tokenizer = load_tokenizer(recipe.model)
    if not recipe.model.random_init and (problem := weights_problem(recipe.model.name_or_path)):
        raise LLMTrainError(problem)
    if recipe.distill is not None:
        from llmtrain.model.teacher import teacher_problem

        if problem := teacher_problem(recipe, tokenizer):
            raise LLMTrainError(problem)
    return config


def needs_problems(recipe, launch: dict, *, user_code: bool = True, tasks: bool = False) -> list[str]:
    """What every process would refuse of this machine's packages and the user's code before its model is read, each
    in its own words, for launch to say once (each process had said it after the processes started, most once per
    process; audit 34) and doctor to fail: a tracker's library not installed (logging.report_to), model.kernels=liger
    without liger-kernel or on a CPU launch (`launch`'s use_cpu, or no CUDA device here), and
    model.attn_implementation=flash_attention_2 without flash-attn or CUDA (its ImportError had come as a traceback
    once the run started; audit 49), the recipe's eval: that
    cannot run (the harness not installed, final/ not saved, a run it cannot score: its tasks' data are read by the
    processes), and the modules
    of online RL's reward functions, tools and environment that do not import (`user_code`; doctor's rows of their
    own import and run them). `tasks`: the eval: tasks known and their data read too (the harness's index, seconds:
    doctor's, where the processes check them under launch)."""
    import torch

    from llmtrain.model.modeling import check_flash_attention, use_liger
    from llmtrain.run.benchmarks import check_recipe
    from llmtrain.run.trackers import check_trackers

    checks = [lambda: check_trackers(recipe.logging.report_to, recipe.logging.project)]
    if recipe.model.kernels == "liger":
        device = "cpu" if launch.get("use_cpu") or not torch.cuda.is_available() else "cuda"
        checks.append(lambda: use_liger(recipe.model, device))
    if recipe.model.attn_implementation == "flash_attention_2":
        device = "cpu" if launch.get("use_cpu") or not torch.cuda.is_available() else "cuda"
        checks.append(lambda: check_flash_attention(recipe.model, device))
    if recipe.eval is not None:
        checks.append(lambda: check_recipe(recipe, tasks=tasks))
    if (rl := recipe.rl) is not None and user_code:
        from llmtrain.data.tools import function_of
        from llmtrain.objectives.rewards import import_reward

        checks += [lambda r=r: import_reward(r.function) for r in rl.rewards if r.type == "function"]
        checks += [lambda t=t: function_of(t) for t in rl.tools]
        if rl.environment:
            checks.append(lambda: function_of(rl.environment, what="rl.environment", form="module:Class"))
    problems = []
    for check in checks:
        try:
            check()
        except LLMTrainError as e:
            problems.append(str(e))
    return problems


def accelerate_command(argv: list[str], *, machine: bool = True) -> list[str]:
    """The `accelerate launch` command line for `llmtrain launch ARGV`, once its checks pass (LLMTrainError if not).
    machine=False leaves out what depends on this machine (its GPUs, the model files in its cache): the command
    alone, as a page shows it."""
    import torch
    from accelerate.commands.launch import launch_command_parser

    from llmtrain import capabilities
    from llmtrain.config import load_recipe, started_in, working_there
    from llmtrain.layout import Layout
    from llmtrain.model.modeling import lora_problem
    from llmtrain.parallel.launch import accelerate_problem, gpus_problem, launch_problem, launch_settings
    from llmtrain.run.checkpoint import resolve_resume
    from llmtrain.run.rundir import (another_runs_recipe, check_output_folder, foreign_checkpoint, inputs_inside,
                                     recipe_inside)

    usage = ("llmtrain launch takes accelerate launch's flags, then a recipe and its overrides, e.g. `llmtrain launch "
             "--config_file accelerate_configs/fsdp.yaml recipes/llama7b.yaml train.max_steps=100` (no -m: it runs "
             "llmtrain finetune itself; `accelerate launch --help` lists the flags)")
    parser = launch_command_parser()

    def refuse(message: str):  # argparse's own error prints accelerate's whole usage (130 lines) and exits 2
        if "required: training_script" in message:  # flags, and no recipe after them
            raise LLMTrainError(f"no recipe given. {usage}.")
        raise LLMTrainError(f"{message.rstrip('.')} (accelerate launch's parser). {usage}.")

    parser.error = refuse
    if not argv:
        raise LLMTrainError(f"no recipe given. {usage}.")
    args = parser.parse_args(argv)
    if args.module or args.no_python or not args.training_script:
        raise LLMTrainError(f"{usage}.")
    recipe_path, rest = args.training_script, list(args.training_script_args)
    if (started := started_in(Path(recipe_path))) is not None:  # a run's saved recipe: from where the run started
        argv = _paths_from_here(argv, len(argv) - len(rest) - 1)
        os.chdir(started)
        args = parser.parse_args(argv)
        recipe_path, rest = args.training_script, list(args.training_script_args)
        print(working_there(recipe_path, started), file=sys.stderr)
    overrides, options = split_finetune_options(rest)
    launch, where = launch_settings(argv)
    # the recipe's problems and the launch config's said together: one round of fixes, not one file after the other
    unhonoured = launch_problem(launch, where=where)
    try:
        recipe = load_recipe(Path(recipe_path), overrides)
    except LLMTrainError as e:
        raise type(e)(f"{e} And {unhonoured}" if unhonoured else str(e)) from None
    if unhonoured:
        raise LLMTrainError(unhonoured)
    layout = Layout.from_launch(launch, recipe, where=where)
    capabilities.check(recipe, layout)  # the recipe on this layout: what every process would refuse, said once
    resuming = any(o == "--resume" or o.startswith("--resume=") for o in options)
    resume, overwrite, out = (_resume_path(options) or "auto") if resuming else None, "--overwrite" in options, \
        Path(recipe.output_dir)
    if problem := (another_runs_recipe(out, Path(recipe_path), overrides)
                   or inputs_inside(out, recipe.model_dump(mode="json"), resume=resume, overwrite=overwrite)
                   or recipe_inside(out, Path(recipe_path), resume=resume, overwrite=overwrite)):
        raise LLMTrainError(problem)
    # a folder the run may not write into, or one another run holds (the processes would each say it)
    check_output_folder(out, overwrite=overwrite, resume=resume)
    if resume not in (None, "auto") and not Path(resume).exists():
        # a mistyped checkpoint, said with the steps there are (whether one is intact each process checks: that reads
        # every block of it)
        resolve_resume(resume, out, warn=print)
    elif resume not in (None, "auto") and (problem := foreign_checkpoint(Path(resume), out, resume)):
        raise LLMTrainError(problem)  # another run's checkpoint into a run: each process would say it
    if resume is not None and not overwrite:
        _check_resume(resume, out, recipe, layout, allow_recipe_change="--allow-recipe-change" in options)
    if machine:  # after the checks of the command alone: these ask torch for GPUs and read the model's files
        if problem := gpus_problem(launch, where=where, gpus=torch.cuda.device_count()) or \
                accelerate_problem(argv, where=where):
            raise LLMTrainError(problem)
        # heads, layers, experts, attention: what the run asks of the model
        config = check_model_files(recipe)
        capabilities.check_model(recipe, layout, config)
        problems = [p for p in (lora_problem(recipe, config), *needs_problems(recipe, launch)) if p]
        if problems:  # (what each process would refuse once its model had loaded, or its packages imported)
            raise LLMTrainError(problems[0] if len(problems) == 1 else " ".join(
                f"({i}) {p.rstrip('.')}." for i, p in enumerate(problems, 1)))
    flags = argv[:len(argv) - len(rest) - 1]  # accelerate's own flags, as given
    return [sys.executable, "-m", "llmtrain.launcher", *flags, "-m", "llmtrain", "finetune", recipe_path, *rest]


def _check_resume(resume: str, out: Path, recipe, layout, *, allow_recipe_change: bool) -> None:
    """What each process would refuse of the resume, said once before any starts: a finished run that cannot go on
    (preflight.finished_run), and a checkpoint this recipe on this layout cannot read (FSDP or not, pipeline stages or
    not, LoRA or full, the micro-batch x data ranks: preflight.check_resume). The checkpoint is the one named, or with
    auto the newest written (its blocks' checksums are each process's to read: a damaged one is skipped there)."""
    from llmtrain.run.checkpoint import named_checkpoint, step_dirs
    from llmtrain.run.preflight import check_resume, finished_run

    if resume == "auto":
        if finished_run(out, recipe, allow_recipe_change=allow_recipe_change) is not None:
            return  # complete with this very recipe: the processes say so and change nothing
        written = [d for d in step_dirs(out / "checkpoints") if (d / "train_state.json").is_file()]
        ckpt = written[-1] if written else None
    else:
        ckpt = named_checkpoint(resume, out)
    if ckpt is not None and (ckpt / "train_state.json").is_file() and (ckpt / "recipe.yaml").is_file():
        # (the input files on several nodes: this node's launcher may not be the main process's; that one compares)
        check_resume(ckpt, recipe, world=layout.data_ranks, fsdp=layout.fsdp, allow_recipe_change=allow_recipe_change,
                     files=[] if layout.nodes > 1 else None)


def _paths_from_here(argv: list[str], recipe_at: int) -> list[str]:
    """`argv` with the paths it names from this directory made absolute: the recipe (at `recipe_at`), accelerate's
    --config_file and finetune's --resume PATH."""
    out = list(argv)
    out[recipe_at] = str(Path(argv[recipe_at]).resolve())
    for i, arg in enumerate(out):
        for flag in ("--config_file", "--config-file", "--resume"):
            if arg.startswith(f"{flag}=") and arg != "--resume=auto":
                out[i] = f"{flag}={Path(arg.split('=', 1)[1]).expanduser().resolve()}"
            elif arg == flag and i + 1 < len(out) and out[i + 1] != "auto":
                out[i + 1] = str(Path(out[i + 1]).expanduser().resolve())
    return out


def launched(argv: list[str]) -> int:
    """`accelerate launch ARGV` in this process (what `llmtrain launch` becomes): its exit status. Where processes
    failed, one line names them and their exit status in place of torchrun's traceback: each has printed why. A
    signal to the launcher (the whole job signalled: SLURM's preemption) is passed to the processes, which save a
    checkpoint and stop; the launcher then exits 128 + the signal, as one process does, with one line, not torchrun's
    traceback."""
    import signal
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))  # torchrun reads it (a user's kept)
    if not args.debug:  # torchrun's own W/E lines on the failure (audit 34): the one line below names the processes
        import logging

        import torch.distributed.run  # noqa: F401  (its elastic loggers exist once imported, each with its level)
        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        launch_command(args)
    except SignalException as e:  # SIGTERM (SLURM, Kubernetes) or Ctrl-C: torchrun passed it on to the processes
        if args.debug:
            raise
        grace = os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
        print(f"llmtrain launch: {signal.Signals(e.sigval).name} reached the launcher, which passed it to the "
              f"processes and gave them {grace} s to save and stop (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before killing "
              "them; what they said is above", file=sys.stderr)
        return 128 + e.sigval  # as one process exits on it (143, 130)
    except (subprocess.CalledProcessError, ChildFailedError) as e:
        if args.debug:
            raise
        alone = isinstance(e, subprocess.CalledProcessError)  # one process, started without torchrun (single GPU)
        codes = {0: e.returncode} if alone else {rank: f.exitcode for rank, f in sorted(e.failures.items())}
        said = "what it said is above" if alone else \
            "what each said is above (accelerate launch --debug: torchrun's own report)"
        print(f"llmtrain launch: {failures(codes)}; {said}", file=sys.stderr)
        # the first that exited with a status (the others may have been ended for it); a signal's: 128 + signal
        code = next((c for c in codes.values() if c > 0), next(iter(codes.values())))
        return code if 0 < code < 256 else 128 - code if code < 0 else 1
    return 0


def failures(codes: dict[int, int]) -> str:
    """The failed processes ({global rank: exit status, -signal where a signal ended it}) in words: those that
    exited with a status, and those a signal ended (the launcher's SIGTERM to the others once one has failed, or a
    kill from outside)."""
    def ranks(items) -> str:
        return f"process{'es' if len(items) > 1 else ''} {', '.join(items)}"

    exited = [f"{rank} (exit status {code})" for rank, code in codes.items() if code >= 0]
    signalled = [f"{rank} (signal {-code})" for rank, code in codes.items() if code < 0]
    return "; ".join([*([f"{ranks(exited)} stopped"] if exited else []),
                      *([f"{ranks(signalled)} ended by a signal"] if signalled else [])])


def launch(argv: list[str]) -> None:
    command = accelerate_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


if __name__ == "__main__":  # what `llmtrain launch` execs (accelerate_command)
    os.environ[LAUNCHED] = "1"
    sys.exit(launched(sys.argv[1:]))
