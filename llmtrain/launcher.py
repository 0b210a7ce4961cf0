"""`llmtrain launch`: check the recipe and the launch config on this machine, then start `accelerate launch`.

`accelerate launch ... -m llmtrain finetune RECIPE` checks the same things, but only once its processes run: a
refusal is then followed by torchrun's report of the failed processes and exits 1. `llmtrain launch` takes the same
arguments as `accelerate launch` (its flags, then the recipe and its overrides) and refuses before any process starts,
with one paragraph and exit status 2; when everything passes it becomes that `accelerate launch` (exec), so its
exit status and signals are the run's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from llmtrain.errors import LLMTrainError

FINETUNE_OPTIONS = {"--resume": 1, "--overwrite": 0, "--allow-recipe-change": 0}  # finetune's own, with arity


def split_finetune_options(args: list[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, finetune's options) from what follows the recipe on the command line."""
    overrides, options, i = [], [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in FINETUNE_OPTIONS:
            arity = 0 if "=" in args[i] else FINETUNE_OPTIONS[name]
            options += args[i:i + 1 + arity]
            i += 1 + arity
        else:
            overrides.append(args[i])
            i += 1
    return overrides, options


def check_model_files(recipe):
    """The model's config and tokenizer, read as every process will read them (a local folder, or the hub's cache
    when the hub does not answer, said in one line): a missing one is said once, here, instead of by each process.
    Returns the model's config."""
    from llmtrain import hub
    from llmtrain.model.modeling import load_model_config, load_tokenizer

    if line := hub.fall_back(hub.recipe_hub_ids(recipe)):
        print(line, file=sys.stderr)
    config = load_model_config(recipe.model)
    load_tokenizer(recipe.model)
    return config


def accelerate_command(argv: list[str], *, machine: bool = True) -> list[str]:
    """The `accelerate launch` command line for `llmtrain launch ARGV`, once its checks pass (LLMTrainError if not).
    machine=False leaves out what depends on this machine (its GPUs, the model files in its cache): the command
    alone, as a page shows it."""
    import torch
    from accelerate.commands.launch import launch_command_parser

    from llmtrain import capabilities
    from llmtrain.config import load_recipe
    from llmtrain.layout import Layout
    from llmtrain.parallel.launch import check_launch, gpus_problem, launch_settings
    from llmtrain.run.rundir import check_output_folder

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
    overrides, options = split_finetune_options(rest)
    recipe = load_recipe(Path(recipe_path), overrides)
    launch, where = launch_settings(argv)
    check_launch(launch, where=where)
    layout = Layout.from_launch(launch, recipe, where=where)
    capabilities.check(recipe, layout)  # the recipe on this layout: what every process would refuse, said once
    if "--resume" not in options:  # a folder the run may not write into (the processes would each say it)
        check_output_folder(Path(recipe.output_dir), overwrite="--overwrite" in options)
    if machine:  # after the checks of the command alone: these ask torch for GPUs and read the model's files
        if problem := gpus_problem(launch, where=where, gpus=torch.cuda.device_count()):
            raise LLMTrainError(problem)
        config = check_model_files(recipe)
        if capabilities.needs_model(recipe, layout):  # heads, layers, experts: what the run asks of the model
            capabilities.check_model(recipe, layout, config)
    flags = argv[:len(argv) - len(rest) - 1]  # accelerate's own flags, as given
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, "-m", "llmtrain", "finetune", recipe_path,
            *rest]


def launch(argv: list[str]) -> None:
    command = accelerate_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
