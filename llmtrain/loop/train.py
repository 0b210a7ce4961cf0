"""The training loop. `train(recipe)` reads top to bottom: set up (phases.py), loop, finish.

The loop body is the step (step.train_step), then small named pieces: the metrics line and the progress bar,
the divergence guard, evaluation with samples, the checkpoint, the stop. When each is due is the cadence's rule
(cadence.py), the speed is the meter's (meter.py), where training is the TrainState's (state.py), and what a
batch is and what is minimised is the objective's (objective.py): none of it is decided here.
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import ExitStack, closing, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from llmtrain.config import Recipe, updates_per_window
from llmtrain.data.batching import prefetch, windows
from llmtrain.errors import LLMTrainError, Stopped, TrainingDiverged
from llmtrain.loop.cadence import Cadence
from llmtrain.loop.guards import adapter_moved, check_finite_weights, diverged
from llmtrain.loop.meter import Meter
from llmtrain.loop.rounds import Rounds
from llmtrain.loop.phases import (
    Data,
    Trainable,
    build_model,
    build_reference,
    build_teacher,
    check_memory,
    claim_run_dir,
    open_log,
    prepare_data,
    quiet_libraries,
    read_only_checks,
    reference_logps,
    restore,
    seed_run,
    separate_draws,
    set_aside_summary,
)
from llmtrain.loop.signals import StopRequests
from llmtrain.loop.step import eval_sums, evaluate, train_step
from llmtrain.memory import predicted_for_run
from llmtrain.memory.fit import out_of_memory_text
from llmtrain.model.reference import Reference
from llmtrain.objectives.objective import Objective, end_of_turn_ids, objective_for, rl_rewards, stop_ids
from llmtrain.parallel.accelerator import build_accelerator
from llmtrain.parallel.collectives import any_process, device_sum, gathered, on_main, on_sampling_group_first
from llmtrain.parallel.groups import groups
from llmtrain.parallel.sequence.shards import SequenceShards
from llmtrain.parallel.mesh import data_ranks
from llmtrain.parallel.pipeline.checkpoint import gather_state_dict, write_stage
from llmtrain.run.checkpoint import discard_later, save_checkpoint
from llmtrain.run.console import RunConsole, step_text, summary_table
from llmtrain.run.export import save_final
from llmtrain.run.metrics import MetricsLog, flop_model, logged, strict_json
from llmtrain.run.plot import update_loss_plot
from llmtrain.run.preflight import check_steps_left
from llmtrain.run.samples import format_sample, generate_samples, mark_answers
from llmtrain.run.state import TrainState
from llmtrain.run.trackers import check_trackers

_KEEP_UNTIL_EXIT: list = []  # a launched process's trained model, never freed before the process exits


def train(recipe: Recipe, *, resume: str | None = None, overwrite: bool = False,
          allow_recipe_change: bool = False) -> dict:
    """Train as the recipe says; returns the summary. Nothing is written before every check has passed; the run
    folder's lock, train.log and the trackers are released however the run ends (finish, stop, divergence)."""
    with ExitStack() as cleanup:
        quiet_libraries()
        # a missing tracker library, a project name wandb refuses: said now, not after the model loads
        check_trackers(recipe.logging.report_to, recipe.logging.project)
        accelerator = build_accelerator(recipe)
        console = RunConsole(enabled=accelerator.is_main_process, progress=recipe.logging.progress,
                             device=accelerator.device.type)
        cleanup.callback(console.close)
        try:
            return _train(recipe, accelerator, console, cleanup, resume=resume, overwrite=overwrite,
                          allow_recipe_change=allow_recipe_change)
        except Exception as e:  # the paragraph the command line prints goes to train.log too (once it is open)
            console.record_error(e)
            raise


def _train(recipe: Recipe, accelerator, console: RunConsole, cleanup: ExitStack, *, resume: str | None,
           overwrite: bool, allow_recipe_change: bool) -> dict:
    """train's body: set up, loop, finish."""
    say = console.say

    # ---- set-up: checks that only read, then data and model; claim_run_dir is the first write
    checked = read_only_checks(recipe, accelerator, resume=resume, overwrite=overwrite,
                               allow_recipe_change=allow_recipe_change, say=say)
    if checked.finished is not None:
        return checked.finished
    seed_run(recipe.train, cleanup)
    data = prepare_data(recipe, accelerator, say=say, config=checked.config)
    check_steps_left(checked.checkpoint, data.total_steps, out=Path(recipe.output_dir))
    # RL: checked before the model loads (a reward model is loaded now, on the run's device)
    rewards = rl_rewards(recipe, data.train, total_steps=data.total_steps, device=accelerator.device,
                         once=partial(on_main, accelerator))
    est = check_memory(recipe, accelerator, data, say=say)  # CUDA: the estimate on this GPU, a warning if over
    state = None
    try:
        trainable = build_model(recipe, accelerator, total_steps=data.total_steps, say=say, pad=data.pad_id)
        separate_draws(recipe, accelerator, trainable, say=say)  # dropout's masks: a stream a slice and a stage
        teacher = build_teacher(recipe, accelerator, trainable, data.tokenizer, say=say)  # distillation's, or None
        if teacher is not None:  # its forward is the step's work too: counted in tflops_per_gpu and mfu
            trainable = replace(trainable, flops=trainable.flops.plus(flop_model(teacher, forward_only=True)))
        reference = build_reference(recipe, accelerator, trainable, say=say)  # a frozen copy, or LoRA's moving one
        objective = objective_for(recipe, pad_id=data.pad_id, model=trainable.unwrapped, tokenizer=data.tokenizer,
                                  train=data.train, world=data_ranks(accelerator)[0], total_steps=data.total_steps,
                                  rewards=rewards, gather=partial(gathered, accelerator),
                                  reduce=partial(device_sum, accelerator), teacher=teacher,
                                  user_code=on_sampling_group_first(accelerator),
                                  reference=reference, stages=trainable.pipeline)
        if recipe.parallel.sequence_parallel > 1:  # each process of a sequence group collates its slice of the row
            objective = SequenceShards(objective, pad_id=data.pad_id, group=groups(accelerator).sequence)
        data = reference_logps(recipe, accelerator, data, trainable, objective, console=console)  # preference only
        run_dir = claim_run_dir(recipe, accelerator, console, checkpoint=checked.checkpoint, resume=resume,
                                overwrite=overwrite)
        cleanup.callback(run_dir.release)
        state = restore(recipe, accelerator, trainable, checkpoint=checked.checkpoint, say=say, objective=objective)
        if accelerator.is_main_process:
            set_aside_summary(Path(recipe.output_dir), resumed=checked.checkpoint is not None)
        # online RL's generation rounds (rl.num_iterations): a checkpoint within one gives its completions back
        rounds = Rounds(updates_per_window(recipe), process=accelerator.process_index,
                        processes=accelerator.num_processes)
        rounds.restore(checked.checkpoint, step=state.step)
        if reference is not None and reference.restore(checked.checkpoint):
            say("reference: the checkpoint's (moved by sync_reference), not the starting weights")
        log = open_log(recipe, accelerator, state, resumed=resume is not None, notes=checked.notes, say=say)
        cleanup.callback(log.close)
        run = Run(recipe=recipe, accelerator=accelerator, console=console, log=log, data=data, model=trainable,
                  objective=objective, rounds=rounds, reference=reference,
                  cadence=Cadence.from_recipe(recipe, total_steps=data.total_steps, has_eval=data.eval is not None),
                  resumed_at=state.step)
        # ---- the loop, then the export and the summary
        # The run's clock: what earlier processes of the run spent, and this one's reference pass (preference)
        meter = Meter(accelerator, flops=trainable.flops, peak=trainable.peak_flops,
                      resumed_s=state.elapsed_s, setup_s=data.reference_s,
                      objective=run.objective)
        train_loop(run, state, meter)
        # the recipe's benchmark (below) scores final/ over the processes: their group stays until it has
        # a stop while final/ is written (a preemption's SIGTERM, a first Ctrl-C) lets it finish: the loop's handlers
        # are gone, and Python's own had killed the process there, the steps since the last checkpoint lost
        with StopRequests(doing="writing final/ and the summary first, then stopping") as late:
            summary = finish(run, state, meter, est, end=recipe.eval is None)
        if late.signum:
            say(f"{signal.Signals(late.signum).name} while final/ was written: it and the summary were finished first; "
                "the run is complete")
    except torch.OutOfMemoryError as e:  # one paragraph with the estimate and what to change, not a traceback
        recipe_path = Path(recipe.output_dir) / "recipe.yaml" if state is not None else "RECIPE.yaml"
        raise LLMTrainError(out_of_memory_text(est, step=state.step if state is not None else -1,
                                               detail=". ".join(str(e).split(". ")[:2]),
                                               recipe_path=str(recipe_path))) from e
    if recipe.eval is not None and any_process(accelerator, bool(late.signum)):  # every process agrees
        say(f"the recipe's benchmark (eval:) is skipped, as the stop asked: score the run with `llmtrain eval "
            f"{recipe.output_dir} --tasks {','.join(recipe.eval.tasks)}`")
        accelerator.end_training()
        return summary
    if recipe.eval is not None:  # the recipe's benchmark, on final/ (check_recipe: it is saved)
        from llmtrain.run.benchmarks import after_training

        # the training's memory, for the harness's model (freed while the process group lives: see finish)
        del run, trainable, objective, teacher, data, rewards
        accelerator.free_memory()
        after_training(recipe, accelerator, say)
        accelerator.end_training()
    return summary


@dataclass(frozen=True)
class Run:
    """What the loop's pieces share, all built before the loop starts."""

    recipe: Recipe
    accelerator: object
    console: RunConsole
    log: MetricsLog
    data: Data
    model: Trainable
    objective: Objective
    rounds: Rounds
    reference: Reference | None  # a full fine-tune's frozen reference, and its sync (TR-DPO)
    cadence: Cadence
    resumed_at: int  # the step this process started from (0, or its checkpoint's)

    @property
    def out(self) -> Path:
        return Path(self.recipe.output_dir)


def train_loop(run: Run, state: TrainState, meter: Meter) -> None:
    """From the state's step to the last: each step, then what the cadence says is due."""
    tc, accelerator, m, total = run.recipe.train, run.accelerator, run.model, run.cadence.total_steps
    evals, checkpoint = [], None
    stream = prefetch(windows(run.data.train, run.data.plan.for_rank(data_ranks(accelerator)[1]), epoch=state.epoch,
                              micro=state.micro_in_epoch, steps=run.rounds.new_windows(state.step, total),
                              accum=tc.grad_accum_steps, collate=run.objective.collate, columns=run.objective.columns,
                              pin=accelerator.device.type == "cuda"))
    progress, task = run.console.progress(total=run.cadence.total_steps, completed=state.step)
    m.model.train()  # from_pretrained returns a model in eval mode: dropout (LoRA's too) must be on
    with progress, StopRequests() as stop_requests, closing(stream):  # closing: the prefetch thread ends here
        if run.recipe.rl is not None and run.data.eval is not None:
            run.console.say(rl_eval_line(run.recipe.rl, len(run.data.eval)))
        for name, fn, _ in getattr(run.objective, "rewards", None) or []:  # a learned reward: what was loaded
            if (what := getattr(fn, "described", None)) is not None:
                run.console.say(f"reward {name}: {what}")
        if run.recipe.rl is not None and (run.recipe.rl.tools or run.recipe.rl.environment):
            rl, tools = run.recipe.rl, run.objective.tools
            syntax, names = tools.syntax, tools.names(per_instance=" (an instance a completion)")
            rounds = ("rounds of calls" if rl.max_tool_calls is None else
                      f"at most {rl.max_tool_calls} round{'s' * (rl.max_tool_calls != 1)} of calls")
            run.console.say(f"tools: {', '.join(names)}, called as the template writes calls "
                            f"({syntax.opener or 'a JSON turn'} with {syntax.name_key!r} and {syntax.arguments_key!r}"
                            f"); {rounds} within max_completion_tokens={rl.max_completion_tokens} (the results count, "
                            f"and are not trained); each call at most {rl.tool_timeout_s:g} s")
        starts_measured = run.recipe.rl is not None or run.recipe.distill is not None
        if starts_measured and run.data.eval is not None and state.step == 0:
            # online RL, distillation: the starting policy's rewards or divergence, which the run is there to improve
            with meter.paused():
                evals.append(evaluate_and_sample(run, state, progress))
        if state.eval_owed and run.data.eval is not None:  # the checkpoint's step's eval, which a stop had cut short
            if getattr(run.objective, "state", None) is not None:  # reward functions see the step it evaluates (the
                # rollout sets it otherwise: 0 before the first step)
                run.objective.state.global_step = state.step
                run.objective.state.epoch = float(state.epoch - (state.micro_in_epoch == 0 and state.epoch > 0))
            run.log.owed_eval(state.step)  # (a line of it an earlier resume wrote, before dying: once)
            with meter.paused():  # a stop cuts it too (it is still owed: the checkpoint is as it was)
                owed = evaluate_and_sample(run, state, progress, stop=stop_requests)
            if owed is None:
                signum = stop_requests.signum or signal.SIGTERM
                raise Stopped(f"{signal.Signals(signum).name} during step {state.step}'s eval, which the checkpoint "
                              f"owes: nothing was trained or saved since it. Continue with: {resume_command(run)}.",
                              signum)
            evals.append(owed)
        state.eval_owed = False
        # a new window a step; online RL with rl.num_iterations > 1: a new one a round, its later steps the round's
        for window in run.rounds.windows(stream, step=state.step, total=total):
            with _stopped_at(run, state.step + 1):
                result = train_step(m.model, m.optimizer, m.scheduler, accelerator, run.objective, window,
                                    max_grad_norm=tc.max_grad_norm, stop_signal=stop_requests.signum,
                                    fsdp_accumulate=tc.fsdp_accumulate, step=state.step, pipeline=m.pipeline)
            run.rounds.trained(result.window)  # a round's first step: its completions, for the later updates
            # One process acts on a signal as soon as its step ends; several act on the votes of the step's
            # collective (a signal that lands during a step is voted on in the next one).
            stop = result.stop_voted if accelerator.num_processes > 1 else bool(stop_requests.signum)
            state.advance(window, result)
            if run.reference is not None:  # sync_reference: the policy mixed into the reference where it is due
                run.reference.after_step(m.unwrapped, state.step)
            meter.add(result, epoch=window.epoch)
            if run.recipe.rl is not None:  # every completion, on record before a stop can come
                # in the order of the prompts' rows: the same file from any number of processes
                rolled = sorted(gathered(accelerator, result.rollouts), key=lambda r: (r["row"], r["generation"]))
                run.log.write_rollouts(rolled)
                for note in run.objective.unscored(rolled):  # a reward function that scored nothing: said once
                    run.console.say(note)
            due = run.cadence.at(state.step, stop=stop, skipped=result.skipped)
            report(run, state, meter, progress, task, logged=due.log, evals=evals)
            guard(run, state, result)  # after its metrics line: a bad step is on record
            cut = False
            if due.eval:
                with meter.paused():  # tokens/s counts training only
                    # a stop ends an eval at its next batch (not the last step's: final/ is written whatever comes)
                    ev = evaluate_and_sample(run, state, progress, stop=stop_requests if state.step < total else None)
                if ev is None:  # cut short, unrecorded: the checkpoint owes it, and the resume runs it first
                    state.eval_owed = cut = True
                else:
                    evals.append(ev)
                    if meter.last:  # the bar shows this eval now (it had shown the one before until the next line)
                        progress.update(task, info=progress_info(run, meter.last, evals))
            if due.save:
                with meter.paused():
                    checkpoint = save(run, state, meter)
            asked = bool(stop_requests.signum)
            if not stop and (due.eval or due.save) and state.step < total and (cut or any_process(accelerator, asked)):
                # a signal that came during this step's eval or save stops here: it had cost another step and a
                # second save, past a 30 s grace period (audit 54); `cut`: every process voted for it already
                stop = True
                if not due.save:  # an eval step is a logged step: the checkpoint is at a metrics line's end
                    with meter.paused():
                        checkpoint = save(run, state, meter)
            if stop:  # a stop is always a save step (cadence): `checkpoint` is this step's
                signum = stop_requests.signum or signal.SIGTERM  # a rank that got no signal stops with its peers
                raise Stopped(f"{signal.Signals(signum).name} at step {state.step}: the checkpoint {checkpoint} is "
                              f"complete. Continue with: {resume_command(run)}.", signum)


# --------------------------------------------------------------------------- the loop's pieces


@contextmanager
def _stopped_at(run: Run, step: int):
    """A user's error that stops a step (a reward function that raises or returns no number, a row the sampler
    cannot render) says the step it stopped and where the run continues from once it is fixed: the step was not
    taken, and the last checkpoint is intact."""
    from llmtrain.run.checkpoint import step_dirs

    try:
        yield
    except (Stopped, TrainingDiverged):
        raise
    except LLMTrainError as e:
        good = (step_dirs(run.out / "checkpoints") or [None])[-1]
        after = (f"The last checkpoint, {good}, is intact: once it is fixed, continue with: {resume_command(run)}."
                 if good else "No checkpoint was written yet.")
        e.args = (f"step {step} stopped: {e} {after}", *e.args[1:])
        raise


def resume_command(run: Run) -> str:
    """The command that continues this run from its newest checkpoint: finetune's for one process, the launch's with
    its own flags for several (finetune's alone had been said, which a launch's layout then refused; audit 36)."""
    recipe = run.out / "recipe.yaml"
    if run.accelerator.num_processes > 1:
        return f"llmtrain launch [the same accelerate flags] {recipe} --resume auto"
    return f"llmtrain finetune {recipe} --resume auto"


def report(run: Run, state: TrainState, meter: Meter, progress, task, *, logged: bool, evals: list[dict]) -> None:
    """The metrics line of a logging step (metrics.jsonl, trackers, the console); the progress bar always."""
    if not logged:
        progress.update(task, completed=state.step)
        return
    line = meter.line(state)
    run.log.write(line)
    progress.update(task, completed=state.step, info=progress_info(run, line, evals))
    run.console.step(line, total=run.cadence.total_steps)


def progress_info(run: Run, line: dict, evals: list[dict]) -> str:
    """The progress bar's text: the last metrics line, and the latest eval's measure."""
    latest = evals[-1] if evals else {}
    latest_eval = (f"  eval {latest['eval_loss']:.4f}" if "eval_loss" in latest else
                   f"  eval reward {latest['eval_reward']:.3f}" if "eval_reward" in latest else "")
    return step_text(line, unit=run.console.unit) + latest_eval


def guard(run: Run, state: TrainState, result) -> None:
    """A skipped update is said; more of them than train.max_bad_steps allows (in the whole run) stop it. Under fp16's
    dynamic loss scale a step whose gradients overflowed at the scale is skipped by the scaler, which halves the
    scale: said, not counted, while the scale is at least 1 (below it the unscaled gradients themselves are not
    finite)."""
    tc = run.recipe.train
    if result.overflow:
        run.console.say(f"step {state.step}: fp16's gradients overflowed at loss scale {2 * result.loss_scale:g}, "
                        f"update skipped; the loss scale is now {result.loss_scale:g} (dynamic loss scaling: not "
                        "counted in train.max_bad_steps)")
    elif result.skipped and state.bad_steps <= tc.max_bad_steps:
        run.console.say(f"step {state.step}: gradient norm {result.grad_norm}, update skipped "
                        f"({state.bad_steps} of train.max_bad_steps={tc.max_bad_steps})")
    if state.bad_steps > tc.max_bad_steps:
        diverged(run.accelerator, run.out, state.step, result.grad_norm, tc)


class EvalCut(Exception):
    """A stop request came during an eval: it ends at its next batch (or before its samples), on every process."""


def evaluate_and_sample(run: Run, state: TrainState, progress, stop: StopRequests | None = None) -> dict | None:
    """Eval metrics (metrics.jsonl), generated samples (samples.jsonl), and loss.png brought up to date. `stop`: the
    loop's stop requests, voted on before each eval batch and before the samples: a signal during the eval ends it
    there, nothing written, and None is returned (an eval of minutes, online RL's generations, had held a
    preemption past its grace period and lost the checkpoint after it)."""
    accelerator, say = run.accelerator, run.console.say
    shown = progress.add_task("eval", total=None, info=f"{len(run.data.eval)} examples")

    def stop_here() -> None:
        if stop is not None and any_process(accelerator, bool(stop.signum)):  # every process ends at one batch
            raise EvalCut

    def next_batch(done: int, total: int) -> None:
        stop_here()
        progress.update(shown, completed=done, total=total)

    try:
        return _evaluate_and_sample(run, state, next_batch, stop_here)
    except EvalCut:
        say(f"step {state.step}'s eval is cut short by the stop: the resumed run evaluates step {state.step} first")
        return None
    finally:
        progress.remove_task(shown)


def _evaluate_and_sample(run: Run, state: TrainState, next_batch, stop_here) -> dict:
    tc, accelerator, eval_ds, say = run.recipe.train, run.accelerator, run.data.eval, run.console.say
    how = dict(batch_size=tc.eval_rows, batch_tokens=tc.eval_tokens, on_batch=next_batch, pipeline=run.model.pipeline)
    if run.recipe.data.sources is not None:  # a mixture: each source's eval rows apart, and together (their sums)
        from llmtrain.data.mixture import eval_parts

        parts = {name: eval_sums(run.model.model, part, accelerator, run.objective, **how)
                 for name, part in eval_parts(run.recipe.data, eval_ds).items()}
        ev = run.objective.eval_metrics([sum(v) for v in zip(*parts.values())])
        if len(parts) > 1:
            ev |= {f"{k}[{name}]": v for name, sums in parts.items()
                   for k, v in run.objective.eval_metrics(sums).items()}
    else:
        ev = evaluate(run.model.model, eval_ds, accelerator, run.objective, **how)
    samples = []
    if tc.eval_samples:  # every rank generates (under FSDP each forward gathers all ranks' shards)
        stop_here()  # a stop during the eval's last batch ends it before the samples
        # KTO: only a desirable row's completion is a reply to expect (an undesirable one had counted as an answer)
        keep = getattr(run.objective, "expected_rows", None)
        rows = [i for i, ok in enumerate(eval_ds[keep]) if ok] if keep else range(len(eval_ds))
        first = eval_ds.select(rows[:tc.eval_samples])
        column = getattr(run.objective, "expected_column", None)  # online RL: the answer column is the expected
        samples = generate_samples(run.model.unwrapped, run.data.tokenizer, first,
                                   max_new_tokens=tc.eval_max_new_tokens, step=state.step,
                                   synced=accelerator.num_processes > 1,
                                   expected=[str(v) for v in first[column]] if column else None,
                                   stops=stop_ids(run.recipe, run.model.unwrapped, run.data.tokenizer),
                                   pipeline=run.model.pipeline)
        if (accuracy := mark_answers(samples, tc.eval_answer_pattern)) is not None:
            ev.setdefault("eval_answer_accuracy", accuracy)  # online RL's eval counted every eval prompt already
            if unparsed := sum(s["expected_answer"] is None for s in samples):  # misses that no reply can fix
                say(f"warning (answers): {unparsed} of {len(samples)} reference answers do not match "
                    f"train.eval_answer_pattern {tc.eval_answer_pattern!r}, so they count as misses in "
                    "eval_answer_accuracy; fix the pattern or the eval data (samples.jsonl shows them)")
    run.log.write({"type": "eval", "step": state.step, **ev})
    run.log.write_samples(samples)  # the main process writes samples.jsonl
    say(f"step {state.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
    if samples:
        say(format_sample(samples[0]))
    # a failure is said and training goes on; before the first step (RL's step-0 eval) there is nothing to plot
    if accelerator.is_main_process and state.step and run.recipe.logging.plot and (note := update_loss_plot(run.out)):
        say(note)
    return {"step": state.step, **ev}


def save(run: Run, state: TrainState, meter: Meter) -> Path:
    """A checkpoint of this step, never of non-finite weights; the state carries the run's clock."""
    check_finite_weights(run.accelerator, run.model.model, state.step)
    state.elapsed_s = meter.elapsed()
    trainable = run.model.trainable_names
    moved = adapter_moved(run.accelerator, run.model.model) if trainable else None
    if moved is False:  # (the save had been refused as broken and the run stopped: audit 12)
        run.console.say(f"note: step {state.step}'s checkpoint holds an adapter that has not moved yet: every LoRA B "
                        "matrix is still 0, every gradient so far having been 0 (online RL: no group's rewards have "
                        "varied yet, frac_reward_zero_std 1)")
    path = save_checkpoint(run.accelerator, output_dir=run.out, state=state, adapter_moved=moved,
                           write_round=partial(run.rounds.write, step=state.step),
                           write_reference=run.reference.write if run.reference is not None else None,
                           recipe_yaml=run.recipe.to_yaml(working_dir=os.getcwd()),
                           keep_last=run.recipe.checkpoint.keep_last, model_keys=set(run.model.model_keys),
                           trainable=set(trainable) if trainable else None,
                           write_stage=partial(write_stage, model=run.model.model, optimizer=run.model.optimizer,
                                               g=groups(run.accelerator).pipeline,
                                               trainable_only=run.recipe.lora is not None)
                           if run.model.pipeline is not None else None)
    run.log.checkpointed()  # the later checkpoints of a run a resume went back on are gone: their lines too
    return path


def finish(run: Run, state: TrainState, meter: Meter, est, *, end: bool = True) -> dict:
    """final/ (the exportable model), summary.json, the summary table and the last loss.png; `end`: then the process
    group's end (False: the caller ends it after scoring final/ over the processes, the model freed first)."""
    accelerator, out, say, m = run.accelerator, run.out, run.console.say, run.model
    if run.recipe.checkpoint.save_final:
        with meter.paused():  # writing final/ is not training time (the summary's training speed had counted it)
            check_finite_weights(accelerator, m.model, state.step)
            whole = (gather_state_dict(m.model, g=groups(accelerator).pipeline,
                                       trainable_only=run.recipe.lora is not None)
                     if m.pipeline is not None
                     else None)  # the stages' weights, gathered: final/ holds the whole model
            with m.pipeline.whole() if m.pipeline is not None else nullcontext():
                save_final(accelerator, m.model, run.data.tokenizer, out / "final", state_dict=whole,
                           end_ids=end_of_turn_ids(run.recipe, run.data.tokenizer))
    method = "full" if run.recipe.lora is None else "qlora" if run.recipe.model.quantize else "lora"
    summary = {"steps": state.step, "method": method, "base_quantization": run.recipe.model.quantize,
               "random_init": run.recipe.model.random_init,
               "params_total": m.params_total, "params_trainable": m.params_trainable,
               "tokens_seen": state.tokens_seen, **meter.summary(),
               "data": {k: _data_summary(v, run.recipe) for k, v in run.data.stats.items()},
               "data_cache_reads": run.data.cache_reads,
               "packing_efficiency": run.data.packing_efficiency}
    if accelerator.device.type == "cuda":
        summary.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                       max_memory_reserved=torch.cuda.max_memory_reserved(),
                       **predicted_for_run(est))
    if accelerator.is_main_process:
        # the whole run's, over every resumed part (metrics.jsonl): the best eval before a resume, the last loss of a
        # run resumed at its last step to write what a stop there had left unwritten (final/, summary.json)
        evals = logged(out, "eval")
        if summary["final_loss"] is None:
            summary["final_loss"] = next((r["loss"] for r in reversed(logged(out, "train"))
                                          if r.get("loss") is not None), None)
        (out / "summary.json").write_text(json.dumps(strict_json(summary), indent=1, allow_nan=False))
        run.log.checkpointed()  # the run is complete: what a resume set aside is of no checkpoint now
        # nor are the checkpoints of the run a resume from an older step went back on: those its own first checkpoint
        # had not replaced (it saved none, or they lie before it; audit 55)
        discard_later(out / "checkpoints", run.resumed_at,
                      keep=lambda step: step <= state.step and run.cadence.at(step).save)
        final_dir = str(out / "final") if run.recipe.checkpoint.save_final else None
        say(summary_table({**summary, "final": final_dir}, out=out, evals=evals, unit=run.console.unit,
                          logged_every=run.recipe.logging.every_steps, online_rl=run.recipe.rl is not None))
        final = summary["final_loss"]
        say(f"done: {state.step} step{'s' * (state.step != 1)}, final loss "
            f"{final if final is None else round(final, 4)}, wrote {out}")
        if run.recipe.logging.plot and (note := update_loss_plot(out)):
            say(note)
    if not end:
        return summary
    accelerator.end_training()
    if accelerator.num_processes > 1:
        # end_training destroyed the process group, so the DDP model's Reducer holds the last reference to the gloo
        # group: freeing the model when this frame ends runs the group's destructor, which joins gloo threads that
        # can wait forever once a peer has left (seen twice in CI: a finished 2-process DPO run's second process
        # hung in ~ProcessGroupGloo for 10 minutes). Kept until the launched process leaves with cli.exit_now,
        # which skips the teardown.
        _KEEP_UNTIL_EXIT.append(run.model)
    return summary


def rl_eval_line(rl, prompts: int) -> str:
    """What online RL's train and eval rewards are of, for the run's log: the train reward's completions are sampled;
    the eval's one greedy completion a prompt (so the train reward usually sits below it), or with
    rl.num_generations_eval N completions a prompt sampled as the rollouts are, from the same seeds at every eval."""
    train = (f"online RL: the train reward is of {rl.num_generations} completions a prompt sampled at "
             f"rl.temperature={rl.temperature:g}; ")
    if rl.num_generations_eval is None:
        return (train + f"eval_reward and eval_answer_accuracy are of one greedy completion of each of the "
                f"{prompts:,} eval prompts, so the train reward usually sits below them")
    return (train + f"eval_reward and eval_answer_accuracy are of {rl.num_generations_eval} completions of each of the "
            f"{prompts:,} eval prompts sampled as the rollouts are (rl.num_generations_eval), from the same seeds at "
            "every eval")


def _data_summary(stats, recipe) -> dict:
    """summary.json's data statistics of a split: a reward model's trained_tokens are its scored tokens, one a
    sequence, as its step lines count them (they had been the answers' tokens, which it never trains: 65,136 for 5,000
    pairs)."""
    out = dict(vars(stats))
    if recipe.reward_model is not None:
        out["trained_tokens"] = 2 * stats.examples
    return out
