"""The command line: parse, load the recipe, call the library. Nothing else lives here.

torch and transformers are imported inside the commands so that `llmtrain --help` stays fast.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrain.errors import Everywhere, LLMTrainError, Relayed, Stopped

# typer's type labels of an option's value (--seed <int>, --top-p <float range>) as click names a value: N, X, PATH
_VALUE_NAMES = {"int": "N", "int range": "N", "float": "X", "float range": "X", "path": "PATH", "file": "PATH",
                "directory": "DIR", "str": "TEXT"}


def _value_name(shown: str | None) -> str | None:
    """An option's value as its help row shows it: a name for typer's <type> (its choices as a|b|c)."""
    if not shown or not shown.startswith("<") or not shown.endswith(">"):
        return shown
    return _VALUE_NAMES.get(shown[1:-1], shown[1:-1])


class _Command(typer.core.TyperCommand):
    """A command whose help names each argument by its metavar alone, as click writes it: typer (0.29) adds the
    argument's type after it (RECIPE.yaml <path>, KEY=VALUE <list[str]>) and braces a required one in the usage line
    ({RECIPE.yaml}); and each option's value by a name (--seed N, --out PATH, --method full|lora), where typer
    writes its type (<int>, <path>, <int range>, <full|lora>)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, typer.core.TyperArgument) and param.metavar:
                shown = (param.metavar if param.required else f"[{param.metavar}]") + "..." * (param.nargs != 1)
                param.display_type_rich = lambda ctx: None
                param._usage_display_name = lambda shown=shown: shown
            elif (isinstance(param, typer.core.TyperOption) and not param.is_flag
                  and hasattr(param, "display_type_rich")):  # (typer before 0.29 has none and writes no type)
                typed = param.display_type_rich
                param.display_type_rich = lambda ctx, typed=typed: _value_name(typed(ctx))


class _Typer(typer.Typer):
    def command(self, *args, **kwargs):
        return super().command(*args, **{"cls": _Command, **kwargs})


app = _Typer(
    help="Fine-tune Llama, Mistral, Qwen, Gemma 3 and 4, Phi and mixture-of-experts models with Hugging Face "
         "Accelerate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: whole option names in 80 columns, no <bool> after a flag
    context_settings={"help_option_names": ["-h", "--help"]},
)

# How long a launched process that leaves the error's paragraph to another (cli.prints_error_here) waits before it
# exits, so that the one that prints exits first: longer than printing and exiting take.
QUIET_EXIT_DELAY_S = 3.0

Overrides = Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE",
                                                         help="Dotted recipe overrides, e.g. train.max_steps=8.")]


def _version(value: bool) -> None:
    """llmtrain's version and the libraries' it trains with, read from the installed packages (nothing imported)."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        def installed(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        libraries = ", ".join(f"{name} {installed(name)}" for name in ("torch", "transformers", "accelerate", "peft"))
        typer.echo(f"llmtrain {installed('llmtrain')} ({libraries})")
        raise typer.Exit()


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
          version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version (and torch's, transformers', accelerate's "
                                                     "and peft's) and exit.")] = False) -> None:
    if debug:
        os.environ["LLMTRAIN_DEBUG"] = "1"
    else:
        warnings.formatwarning = one_line_warning


def one_line_warning(message, category, filename, lineno, line=None, *, _default=warnings.formatwarning) -> str:
    """llmtrain's own warnings (warnings.warn in its modules: the fast sampler's fall-back to the reference loop) as
    one line, `warning: ...`, as the run's other warnings read, not Python's file, line and source line; the
    libraries' warnings as Python writes them (with --debug, every warning as Python writes it)."""
    if str(filename).startswith(str(Path(__file__).parent)):
        return f"warning: {message}\n"
    return _default(message, category, filename, lineno, line)


# What a stop at once leaves, by command (the training one's had been said after generate too; audit 42)
_RUN = (": nothing more was saved. A run goes on from its newest checkpoint with --resume auto (with none yet, it "
        "starts again).")
STOPPED_AT_ONCE = {"finetune": _RUN, "launch": _RUN,
                   "generate": ": --out, where given, holds the replies of every batch drawn before it."}


def user_errors(fn):
    """Print an LLMTrainError as one paragraph and exit 2; a traceback only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LLMTrainError as e:
            if os.environ.get("LLMTRAIN_DEBUG"):
                raise
            from rich.console import Console
            from rich.markup import escape

            label = "stopped" if isinstance(e, Stopped) else "error"
            if prints_error_here(stopped=isinstance(e, (Stopped, Relayed, Everywhere))):
                Console(stderr=True).print(f"[bold red]{label}:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
                if not isinstance(e, Stopped) and (hint := plain_launch_hint()):
                    Console(stderr=True).print(hint, highlight=False, soft_wrap=True, style="dim")
            else:
                # The launcher ends every process as soon as the first one exits. Leave the first exit to the process
                # that prints: one that left sooner could have it ended before its paragraph is out, and torchrun's
                # report would name this process, which said nothing. The launcher ends this one when that one exits.
                time.sleep(QUIET_EXIT_DELAY_S)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:  # a second Ctrl-C in training, or one before it started or in another
            # command: it had ended with no word (audit 11); a SIGTERM before the loop (signals.StoppedAtOnce)
            if os.environ.get("LLMTRAIN_DEBUG"):
                raise
            import signal

            signum = getattr(e, "signum", signal.SIGINT)
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"\nstopped at once ({what}){STOPPED_AT_ONCE.get(fn.__name__, '.')}", file=sys.stderr, flush=True)
            raise typer.Exit(128 + signum) from None

    return wrapper


def plain_launch_hint() -> str | None:
    """Under a plain `accelerate launch` (torchrun's processes, not llmtrain launch's), a line after the error: torch's
    launcher follows it with its report of the failed processes, a 40-line traceback of its own that reads as if
    llmtrain had crashed. Said once a node; None otherwise."""
    from llmtrain.launcher import LAUNCHED

    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(LAUNCHED) or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    return ("(torch's launcher reports the failed processes below with a traceback of its own: the reason is the "
            "paragraph above. `llmtrain launch` takes accelerate launch's arguments, checks the recipe and the launch "
            "before any process starts, and reports a failed process in one line.)")


def prints_error_here(*, stopped: bool = False) -> bool:
    """Whether this process prints the error it raised. Before the process group exists every process of a launch
    has checked the same recipe and launch config and raises the same paragraph: the first process of each node
    (torchrun's LOCAL_RANK 0) prints it, once per node's log, not once per GPU. So does a stop on a signal
    (`stopped`): every rank stops after the same step, which they voted on together; another process's error
    handed to this one (errors.Relayed), which that process prints itself; and an error every process finds alike
    (errors.Everywhere: the data checks). Once the group exists
    (Accelerate's PartialState is set up), every process prints any other error: a rank's error may be its alone."""
    state = sys.modules.get("accelerate.state")
    if not stopped and state is not None and state.PartialState._shared_state:
        return True
    return os.environ.get("LOCAL_RANK", "0") == "0"


def ask_hub_first(recipe) -> None:
    """Before huggingface_hub, transformers and datasets are imported (they read HF_HUB_OFFLINE then): whether the
    hub answers, once (llmtrain.hub); when it does not, the recipe's hub ids are read from the local cache only,
    said in one line, once per node."""
    from llmtrain import hub

    line = hub.fall_back(hub.recipe_hub_ids(recipe))
    if line and prints_error_here():
        typer.echo(line, err=True)


def ask_hub_for(*sources: str | None, also: tuple[str, ...] = (), say: bool = True) -> None:
    """ask_hub_first for a command given runs or models (generate, export, eval): the hub ids of each source's model
    (a run's or a checkpoint's base and tokenizer, else the source itself) and `also` (what else it reads from the
    hub, said in the line); without the hub they are read from the cache at once, where each would have retried the
    network for most of a minute. `say`: print the line (the main process of several)."""
    from llmtrain import hub
    from llmtrain.run.rundir import run_recipe

    ids: list[str] = []
    for source in filter(None, sources):
        path = Path(source).expanduser()
        if (path / "recipe.yaml").is_file():
            model = run_recipe(path).model
            ids += hub.hub_ids(model.name_or_path, model.tokenizer)
        else:
            ids += hub.hub_ids(source)
    if (line := hub.fall_back([*dict.fromkeys(ids), *also])) and say:
        typer.echo(line, err=True)


def where_it_started(recipe: Path, resume: str | None = None) -> tuple[Path, str | None]:
    """A run's own saved recipe (its recipe.yaml or a checkpoint's, config.started_in) runs from the directory that
    run was started in: this process works there, said in one line, so its relative paths (output_dir, data, model)
    and the overrides' are read from there; the recipe's path and --resume's are made absolute first. Any other
    recipe: as given, from here. Returns (recipe, resume)."""
    from llmtrain.config import started_in, working_there

    if (started := started_in(recipe)) is None:
        return recipe, resume
    recipe = recipe.resolve()
    if resume is not None and resume != "auto":
        resume = str(Path(resume).expanduser().resolve())
    os.chdir(started)
    if prints_error_here():
        typer.echo(working_there(recipe, started), err=True)
    return recipe, resume


@app.command(short_help="Train as a recipe says (one process, or under accelerate launch).")
@user_errors
def finetune(
    recipe: Annotated[Path, typer.Argument(metavar="RECIPE.yaml", help="YAML recipe.")],
    overrides: Overrides = None,
    resume: Annotated[
        Optional[str], typer.Option(metavar="auto|PATH",
                                    help="'auto' for the latest complete checkpoint in output_dir, or a path.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Start again in an existing run folder (deletes the old run).")] = False,
    allow_recipe_change: Annotated[bool, typer.Option("--allow-recipe-change",
        help="On --resume, continue with a changed schedule (max_steps, epochs, lr, ...), said and recorded.")] = False,
) -> None:
    """Fine-tune a model as the recipe describes (run it under `accelerate launch` to scale out)."""
    from llmtrain.config import load_recipe
    from llmtrain.loop.signals import stop_at_once_on_sigterm, stop_with_the_launcher

    stop_at_once_on_sigterm()  # before the loop: one line and 143, not a silent -15
    stop_with_the_launcher()  # a launcher killed by SIGKILL leaves no process training on without it
    recipe, resume = where_it_started(recipe, resume)
    checked = load_recipe(recipe, overrides)  # a missing file or a bad key is said before torch is imported
    from llmtrain.run.rundir import another_runs_recipe, recipe_inside

    out = Path(checked.output_dir)
    if problem := (another_runs_recipe(out, recipe, overrides)
                   or recipe_inside(out, recipe, resume=resume, overwrite=overwrite)):
        raise LLMTrainError(problem)
    ask_hub_first(checked)
    from llmtrain.loop.train import train

    train(checked, resume=resume, overwrite=overwrite, allow_recipe_change=allow_recipe_change)


@app.command(short_help="Check a recipe and its launch config, then accelerate launch it.",
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             options_metavar="[ACCELERATE LAUNCH FLAGS] RECIPE.yaml [KEY=VALUE]... [FINETUNE OPTIONS]", epilog=(
                 "Accelerate's flags, as `accelerate launch --help` lists them: --config_file PATH, --num_processes "
                 "N, --num_machines N, --machine_rank R, --main_process_ip IP, --main_process_port PORT, "
                 "--parallelism_config_dp_shard_size N (a flag wins over the config file, as in accelerate). "
                 "FINETUNE OPTIONS: --resume auto|PATH, --overwrite, --allow-recipe-change."))
@user_errors
def launch(ctx: typer.Context) -> None:
    """Check a recipe and its launch before any process starts, then run it under `accelerate launch`: `llmtrain
    launch [ACCELERATE LAUNCH FLAGS] RECIPE [OVERRIDES] [--resume auto]`, e.g. `llmtrain launch --config_file
    accelerate_configs/fsdp.yaml recipes/llama7b.yaml`. A refusal exits 2 before torchrun starts."""
    from llmtrain.launcher import launch as run

    run(list(ctx.args))


@app.command("inspect-data", short_help="Formatted examples with the trained tokens, and data statistics.")
@user_errors
def inspect_data(
    recipe: Annotated[Path, typer.Argument(metavar="RECIPE.yaml", help="YAML recipe.")],
    overrides: Overrides = None,
    n: Annotated[int, typer.Option("--n", "-n", min=0, help="How many formatted examples to show.")] = 3,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per example, the rows training reads: input_ids and labels (a pair's "
        "chosen_ids, chosen_labels, rejected_ids, rejected_labels, a reward model's chosen_scored_at and "
        "rejected_scored_at in place of the labels, and margin where the data have it; KTO's label; an RL "
        "prompt's columns for the rewards; a mixture's source).")] = False,
) -> None:
    """Show formatted examples with trained tokens highlighted, and dataset statistics."""
    from llmtrain.config import load_recipe
    from llmtrain.inspect_data import inspect_data as run

    recipe, _ = where_it_started(recipe)
    checked = load_recipe(recipe, overrides)
    ask_hub_first(checked)
    run(checked, n=n, as_json=as_json)


@app.command(short_help="Merge a LoRA run's adapter into its base: a whole model.")
@user_errors
def export(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A finished LoRA run's output_dir (or its "
                                            "final/).")],
    merge: Annotated[bool, typer.Option("--merge", help="Merge the run's LoRA adapter into its base and write a full "
                                        "model (required: the one thing export does).")] = False,
    out: Annotated[Optional[Path], typer.Option(help="Where to write (default <run_dir>/final-merged).")] = None,
) -> None:
    """Write a merged full model from a LoRA run's final adapter."""
    from llmtrain.run.export import export_merged

    if merge:
        ask_hub_for(str(run_dir))
    path = export_merged(run_dir, out, say=lambda text: typer.echo(text, err=True)) if merge else None
    if path is None:
        raise LLMTrainError("Nothing to do: `llmtrain export RUN_DIR --merge` merges a LoRA run's adapter.")
    typer.echo(str(path))  # stdout: the path alone, for scripts


@app.command(short_help="Replies from a finished run (its final/) or a model, with llmtrain's sampler.")
@user_errors
def generate(
    source: Annotated[str, typer.Argument(metavar="RUN_OR_MODEL",
                                          help="A finished run's output_dir, one of its checkpoints (checkpoints/"
                                          "step_N), a model folder or a hub id.")],
    prompts: Annotated[Optional[list[str]], typer.Argument(metavar="PROMPT", help="Prompts to reply to.")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(
        "--prompts", help="A file of prompts: one a line, or JSON lines with a \"prompt\" (.jsonl).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        min=1, help="Most new tokens a reply has (default: the run's rl.max_completion_tokens, else 256).")] = None,
    temperature: Annotated[Optional[float], typer.Option(
        min=0.0, help="0: greedy (the default, or the run's rl.temperature).")] = None,
    top_p: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Nucleus sampling.")] = None,
    top_k: Annotated[Optional[int], typer.Option(min=0, help="Only the k most likely tokens (0: all).")] = None,
    min_p: Annotated[Optional[float], typer.Option(
        min=0.0, max=1.0, help="Only tokens at least this times the most likely one's probability (0: off).")] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(
        help="Tokens of the prompt and the reply so far made less likely (transformers' "
        "repetition_penalty: above 1 repeats less; default 1, off, or the run's rl.repetition_penalty).")] = None,
    samples: Annotated[int, typer.Option(min=1, help="Replies a prompt (each from its own seed).")] = 1,
    seed: Annotated[int, typer.Option(help="The replies' seed: the same seed, the same replies.")] = 0,
    chat: Annotated[Optional[bool], typer.Option(
        "--chat/--no-chat", help="Render prompts through the chat template (default: as the run's data did; a "
        "model: where its tokenizer has one).")] = None,
    system: Annotated[Optional[str], typer.Option(help="A system message before each prompt (chat only).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Also write the replies as JSON lines to this new file.")] = None,
    tools: Annotated[Optional[bool], typer.Option(
        "--tools/--no-tools", help="Run the replies' tool calls as the run's rollouts did (default: where the run "
        "sampled with rl.tools or rl.environment; --prompts rows' other fields reset its environment).")] = None,
) -> None:
    """Reply to prompts with a finished run's model (a LoRA adapter applied to its base) or any model, through the
    chat template as the run rendered its data, with llmtrain's own sampler: greedy unless a temperature is given."""
    import json

    from llmtrain.run.replies import generate_replies, load_source, read_prompts
    from llmtrain.run.rundir import cannot_create

    texts = list(prompts or []) + (read_prompts(prompts_file) if prompts_file is not None else [])
    if out is not None and (out.exists() or (problem := cannot_create(out, "--out"))):
        raise LLMTrainError(f"--out '{out}' already exists; give a new file" if out.exists() else problem)
    if not texts:
        raise LLMTrainError("no prompt to reply to: give prompts after the source, or --prompts FILE (one a line, "
                            "or JSON lines with a \"prompt\")")
    ask_hub_for(source)
    src = load_source(source)
    rendered = src.chat if chat is None else chat
    typer.echo(f"replies from {src.describe}; prompts "
               + ("through the chat template" if rendered else
                  "in the run's Alpaca template (each prompt its instruction, a --prompts row's input its input)"
                  if src.alpaca and chat is None else "as plain text") + (
                   " (--chat / --no-chat to change)" if chat is None else ""), err=True)

    def each_batch(replies: list[dict]) -> None:
        """Print and write a batch's replies once drawn: a stop (Ctrl-C) keeps the ones before it (--out had been
        written at the end alone; audit 11). --out is created with the first batch, after every check."""
        for r in replies:
            tag = f" (sample {r['sample']})" if samples > 1 else ""
            prompt = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
            typer.echo(f"prompt{tag}: {prompt}\nreply: {r['reply']}" + ("" if r["stopped"] else " [cut at the limit]"))
            for call in r.get("calls", []):
                typer.echo(f"  tool call: {call['name']}({json.dumps(call['arguments'])}) -> {call['result']}"
                           + (" [failed]" if call["failed"] else ""))
        if out is not None:
            kept = out.stat().st_size if out.exists() else 0
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in replies))
            except OSError as e:  # a full disk: the batch's lines out again, whole lines only (audit 46)
                if out.is_file():
                    os.truncate(out, kept)
                raise LLMTrainError(f"--out '{out}' could not be written ({e.strerror or e}); it holds the replies "
                                    "of the batches before this one, whole lines only (those printed above this "
                                    "batch's). Free space there, or give --out on another disk.") from None

    replies = generate_replies(src, texts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, samples=samples,
                               seed=seed, chat=chat, system_prompt=system, tools=tools, each_batch=each_batch)
    if out is not None:
        typer.echo(f"wrote {len(replies)} repl{'ies' if len(replies) != 1 else 'y'} to {out}", err=True)


@app.command("eval", short_help="Benchmark scores of a run or a model through lm-evaluation-harness.")
@user_errors
def eval_(
    target: Annotated[str, typer.Argument(metavar="RUN_OR_MODEL",
                                          help="A finished run's output_dir (its final/: a LoRA adapter on its base), "
                                          "one of its checkpoints, a model folder or a hub id.")],
    tasks: Annotated[str, typer.Option(
        metavar="TASKS", help="The harness's task names, comma-separated (gsm8k,hellaswag).")],
    num_fewshot: Annotated[Optional[int], typer.Option(
        min=0, metavar="N", help="Few-shot examples (default: each task's).")] = None,
    batch_size: Annotated[str, typer.Option(metavar="N|auto", help="Examples a forward pass, or 'auto'.")] = "1",
    limit: Annotated[Optional[float], typer.Option(
        min=0.0, metavar="N", help="At most this many examples a task (or, below 1, this share of them).")] = None,
    include_path: Annotated[Optional[list[Path]], typer.Option(
        "--include-path", metavar="DIR",
        help="A folder of task YAML files (tasks on local data; tasks/ has the tiny task's).")] = None,
    baseline: Annotated[Optional[str], typer.Option(
        metavar="RUN_OR_MODEL|base", help="Also score this model (a run, a model folder or a hub id; 'base': the "
        "run's base model) and print the two side by side.")] = None,
    chat_template: Annotated[bool, typer.Option(
        "--apply-chat-template", help="Render each request through the model's chat template (the harness's "
        "--apply_chat_template).")] = False,
    dtype: Annotated[str, typer.Option(
        metavar="DTYPE", help="The weights' dtype as the harness loads them (auto: the model's).")] = "auto",
    device: Annotated[Optional[str], typer.Option(
        metavar="DEVICE", help="cuda, cpu, ... (default: cuda where there is one).")] = None,
) -> None:
    """Score a finished run (a LoRA adapter on its base, as `lm_eval --model_args pretrained=BASE,peft=ADAPTER` loads
    it) or any model on lm-evaluation-harness tasks, with the harness's own defaults: the same numbers its CLI
    prints. The results go into the run's lm_eval/ folder; --baseline scores a second model beside it."""
    from llmtrain.run import benchmarks

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise LLMTrainError("--tasks names no task: give the harness's task names, comma-separated (e.g. gsm8k)")
    size, device = benchmarks.command_options(batch_size, limit=limit, dtype=dtype, device=device)
    main = int(os.environ.get("RANK", "0")) == 0
    from llmtrain.hub import local_tasks

    local = local_tasks([str(p) for p in include_path or []], names)  # (their data: files here)
    ask_hub_for(target, None if baseline == "base" else baseline, also=() if local else ("the tasks' datasets",),
                say=main)
    ours = benchmarks.resolve(target, dtype=dtype)
    base = None
    if baseline is not None:
        base = (benchmarks.base_of(ours, dtype=dtype) if baseline == "base"
                else benchmarks.resolve(baseline, dtype=dtype))
    benchmarks.quiet()
    manager = benchmarks.task_manager([str(p) for p in include_path or []], names)
    benchmarks.check_tasks(names, manager)
    chats = benchmarks.rendering(ours) if chat_template else {}  # the run's system prompt and template kwargs
    how = dict(num_fewshot=num_fewshot, batch_size=size, limit=limit, apply_chat_template=chat_template, device=device,
               **({"chats": chats} if chats else {}))  # for the baseline too (recorded)
    if main and not chat_template and (note := benchmarks.template_note(ours)):
        typer.echo(note, err=True)
    unkept = benchmarks.unkept(ours.run) if ours.run is not None else None
    if main and unkept:
        typer.echo(f"note: the scores cannot be kept in {ours.run / 'lm_eval'} ({unkept}): they are printed only",
                   err=True)
    if main:
        typer.echo(f"scoring {ours.name} on {', '.join(names)} (lm-evaluation-harness)", err=True)
    results = benchmarks.evaluate(ours, names, manager, **how)
    if main and base:
        typer.echo(f"scoring {base.name} (the baseline) on {', '.join(names)}", err=True)
    base_results = benchmarks.evaluate(base, names, manager, **how) if base else None
    if not main or results is None:
        return
    if base_results is not None:  # two tables on stdout: each named (audit 33: which was which had been stderr's)
        typer.echo(f"{ours.name}:")
    typer.echo(benchmarks.table(results))
    if base_results is not None:
        typer.echo(f"{base.name} (the baseline):")
        typer.echo(benchmarks.table(base_results))  # the baseline's own, with its stderr
        from rich.console import Console
        from rich.table import Table

        side = Table(title=f"{ours.name} against {base.name}")
        for column in ("task", "metric", "model", "baseline", "difference"):
            side.add_column(column, justify="left" if column in ("task", "metric") else "right")
        for row in benchmarks.side_by_side(results, base_results, names=(ours.name, base.name)):
            side.add_row(*row)
        Console().print(side)
    if ours.run is not None and not unkept:
        record = benchmarks.record(ours, names, how, results, base, base_results)
        typer.echo(f"wrote {benchmarks.write(ours.run, record)}", err=True)


@app.command("prepare-tiny", short_help="Write the tiny model and task the demo recipes train.")
@user_errors
def prepare_tiny(
    out: Annotated[Path, typer.Argument(metavar="DIR",
                                          help="Folder for the tiny model, tokenizer and data.")] = Path("assets/tiny"),
    family: Annotated[str, typer.Option(
        "--family", metavar="MODEL_TYPE",
        help="The tiny model in this family's layer (qwen3, gemma3_text, phi3, qwen3_moe, ...: docs/models.md), the "
             "same task: try a family's path on the CPU.")] = "llama",
) -> None:
    """Create the tiny random-init Llama, its tokenizer and the synthetic task data used by recipes/tiny.yaml. A
    folder it wrote before is written again if its files are as it wrote them (the same family and seed); one holding
    anything else is refused."""
    from llmtrain.tiny import prepare_tiny as run

    again = run(out, family=family)
    typer.echo(f"wrote {out}" + (f" ({family}'s layer)" if family != "llama" else "") +
               (" again (its model/ and data/ as prepare-tiny writes them)" if again else ""))


from llmtrain.memory.cli import estimate_memory  # noqa: E402  (typer options only; no torch at import)

def _estimated_where_it_started(**kwargs) -> None:
    """estimate-memory, a run's own saved recipe read from where that run started (where_it_started), as finetune,
    launch and doctor read it: its data, model and reward models' relative paths are from there. --accelerate-config
    is made absolute first."""
    if isinstance(kwargs.get("recipe"), Path) and kwargs["recipe"].is_file():
        if kwargs.get("accelerate_config") is not None:
            kwargs["accelerate_config"] = kwargs["accelerate_config"].absolute()
        kwargs["recipe"], _ = where_it_started(kwargs["recipe"])
    estimate_memory(**kwargs)


functools.update_wrapper(_estimated_where_it_started, estimate_memory)  # typer reads estimate_memory's options
app.command("estimate-memory", short_help="Per-GPU peak memory before renting a GPU; what fits (--fit).")(
    user_errors(_estimated_where_it_started))


@app.command(short_help="Pass/warn/fail preflight: tokenizer, data, masks, memory, launch.")
@user_errors
def doctor(
    recipe: Annotated[Path, typer.Argument(metavar="RECIPE.yaml", help="YAML recipe.")],
    overrides: Overrides = None,
    accelerate_config: Annotated[Optional[Path], typer.Option(
        help="The accelerate launch config the run will use (mixed precision, FSDP, processes, machines).")] = None,
    gpu_memory: Annotated[Optional[float], typer.Option(
        help="Memory of one GPU in GiB (default: the GPU present).")] = None,
    show_recipe: Annotated[bool, typer.Option("--show-recipe", help="Print the resolved recipe first.")] = False,
) -> None:
    """Check a recipe before spending GPU time: tokenizer, data and masks, memory, launch config. Exit 1 on a fail."""
    from llmtrain.config import load_recipe
    from llmtrain.doctor import doctor as run
    from llmtrain.memory.cli import launch_from_header

    if gpu_memory is not None and gpu_memory <= 0:  # (estimate-memory's own check, before anything is read)
        raise LLMTrainError(f"--gpu-memory {gpu_memory:g}: a GPU's memory must be positive, in GiB (e.g. 80 for an "
                            "H100, 141 for an H200).")
    accelerate_config = accelerate_config and accelerate_config.absolute()
    recipe, _ = where_it_started(recipe)
    loaded = load_recipe(recipe, overrides)
    code = run(loaded, accelerate_config=accelerate_config or launch_from_header(recipe), gpu_memory=gpu_memory,
               show_recipe=show_recipe, recipe_file=recipe, overrides=overrides)
    raise typer.Exit(code)


@app.command(short_help="Loss, eval and lr curves of one run, or several overlaid.")
@user_errors
def plot(
    runs: Annotated[list[Path], typer.Argument(
        metavar="RUN", help="One or several run folders (the output_dir of finetune).")],
    out: Annotated[Optional[Path], typer.Option(
        help="Image to write (default RUN/loss.png for one run, ./loss-compare.png for several).")] = None,
) -> None:
    """Plot train loss (and its moving average), eval loss and lr against steps and tokens; for online RL runs the
    reward (and each reward's), eval accuracy and reward, completion length and KL against steps. Several runs
    overlaid."""
    from llmtrain.run.plot import default_plot_path, drawn_here, plot_runs

    if out is not None and out.is_file() and not drawn_here(out):  # (any file of an image's suffix had been replaced)
        raise LLMTrainError(f"--out '{out}' already exists and is not a plot llmtrain drew: give a new file name (or "
                            "remove that file); nothing was written.")
    out = out or default_plot_path(runs)
    replaced = out.is_file()
    plot_runs(runs, out)
    typer.echo(f"wrote the curves of {len(runs)} run{'s' * (len(runs) > 1)} ({', '.join(map(str, runs))}) to {out}"
               + (" (it replaced the plot there; --out names another)" if replaced else ""), err=True)
    typer.echo(str(out))  # stdout: the path alone, for scripts


def run(args: list[str] | None = None) -> int | str | None:
    """Run one command (default: the command line's) and return what it exits with, without exiting. --debug, an
    option of llmtrain's, is taken after the command too (`llmtrain finetune R.yaml --debug` had been click's bare "No
    such option"; audit 36), but for launch's, whose flags are accelerate launch's (its own --debug)."""
    args = list(sys.argv[1:] if args is None else args)
    command = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if command is not None and args[command] != "launch" and "--debug" in args[command + 1:]:
        args = ["--debug", *(a for i, a in enumerate(args) if i <= command or a != "--debug")]
    try:
        app(prog_name="llmtrain", args=args)
    except SystemExit as e:
        return e.code
    return 0


def main() -> None:
    """The `llmtrain` command. A process of a multi-process launch (torchrun's WORLD_SIZE > 1) whose command succeeded
    or stopped on request leaves with `exit_now`, skipping the interpreter's teardown (where a stopped process's gloo
    thread had aborted it: "terminate called without an active exception"). A failed one exits the usual way: it
    must not leave sooner than before, since the launcher ends the others when the first one exits and the process
    that prints the reason for all of them (cli.prints_error_here) may not have printed it yet."""
    code = run()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (not code or code in STOP_CODES):  # a stop: said, or saved
        exit_now(code)
    teardown_ends_on_a_signal(code)
    sys.exit(code)


STOP_CODES = (130, 143)  # 128 + SIGINT, 128 + SIGTERM: a stop on request, at once or after its checkpoint


def teardown_ends_on_a_signal(code: int | str | None) -> None:
    """Once the command has returned, SIGTERM or Ctrl-C ends the process at once with the command's own exit status:
    what the command wrote is complete, and the interpreter's teardown is all that is left. (A launcher's SIGTERM
    during it, torchrun's answer to a second Ctrl-C, had raised the stop handler's exception in an atexit callback:
    "Exception ignored in atexit callback" and a traceback after the run's last line; audit 54.)"""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: exit_now(code))


def exit_now(code: int | str | None) -> None:
    """`sys.exit(code)` without the interpreter's teardown (os._exit, once what was printed is flushed). A launched
    process that returns from its command has closed every file, finished the trackers and destroyed the process
    group; what is left is the teardown, and that can crash: FSDP's modules keep the gloo process group alive until
    then, and a gloo thread that touches a tensor while the interpreter is being torn down aborts the process
    (`terminate called without an active exception`, pytorch#179291), so a run that finished and wrote everything
    exits -6 and the launcher reports a failure (seen once in CI, in a 2-process FSDP run). A non-integer code is
    printed, as sys.exit prints it, and exits 1."""
    import logging

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to save
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
