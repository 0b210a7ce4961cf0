"""The training loop. `train(recipe)` reads top to bottom: set up, loop, finish; `train_step(window)` is one
optimizer step.

Loss normalisation: the loss of an optimizer step is the sum of token losses over every micro-batch
of the accumulation window on every process, divided by the number of trained tokens in that whole
window. So micro-batch 8 x accumulation 1, micro-batch 1 x accumulation 8 and 2 processes x micro-batch
4 all give the same loss and the same gradient, however the tokens are spread over the examples.

Host syncs: token counts come from the CPU batches (batching.windows) and are summed over processes in
one collective per step, kept on the device; the loss and the gradient norm are read back (`.item()`)
only on the steps that write a metrics line (logging.every_steps), and at evaluation and save.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
import warnings
from contextlib import ExitStack, closing, contextmanager, nullcontext
from pathlib import Path

import torch

from llmtrain.batching import global_micro_batches, prefetch, windows
from llmtrain.checkpoint import TrainState, load_checkpoint, lora_only_hooks, save_checkpoint
from llmtrain.chat import read_template
from llmtrain.config import Recipe
from llmtrain.console import RunConsole, step_text, summary_table
from llmtrain.data import prepare_datasets
from llmtrain.distributed import build_accelerator, global_sum, receives_weights, use_fused_adamw, uses_fsdp
from llmtrain.doctor import check_eos_trained, check_masks
from llmtrain.errors import LLMTrainError, Stopped
from llmtrain.export import save_final
from llmtrain.guards import check_finite_weights, diverged
from llmtrain.loss import attach_loss, compute_loss
from llmtrain.memory import predicted_for_run
from llmtrain.metrics import MetricsLog, flop_model, peak_flops, strict_json
from llmtrain.modeling import (
    build_optimizer,
    compile_layers,
    count_parameters,
    describe_attention,
    fused_linear_cross_entropy,
    load_model,
    load_tokenizer,
    pad_id,
)
from llmtrain.plot import update_loss_plot
from llmtrain.preflight import check_resume, finished_run
from llmtrain.rundir import check_output_dir, claim_output_dir
from llmtrain.samples import format_sample, generate_samples
from llmtrain.signals import StopRequests
from llmtrain.trackers import check_trackers, open_trackers

# --------------------------------------------------------------------------- small pure helpers


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier on the peak lr for the update at index `step` (0-based): linear warmup, then decay."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def packs_rows(recipe: Recipe) -> bool:
    """Micro-batches are padding-free packed rows: asked for, implied by a token budget, or required by the
    varlen attention (which reads the example boundaries of a packed row)."""
    return bool(recipe.data.packing or recipe.train.micro_batch_tokens
                or recipe.model.attn_implementation in ("auto", "varlen"))


def data_plan(recipe: Recipe, lengths: list[int], *, world: int, rank: int | None = None):
    """plan(epoch) -> every global micro-batch of that epoch (a list per rank), or this rank's own lists."""
    tc = recipe.train

    @functools.lru_cache(maxsize=2)
    def plan(epoch: int):
        batches = global_micro_batches(len(lengths), seed=tc.seed, epoch=epoch, world_size=world,
                                       micro_batch_size=tc.micro_batch_size,
                                       micro_batch_tokens=tc.micro_batch_tokens, lengths=lengths)
        return batches if rank is None else [g[rank] for g in batches]

    return plan


def to_device(batch: dict, device) -> dict:
    # non_blocking: the copy from pinned memory overlaps with whatever the GPU is still doing.
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# --------------------------------------------------------------------------- one step, and evaluation


def train_step(model, optimizer, scheduler, accelerator, window, *, max_grad_norm: float | None,
               stop_signal: int) -> dict:
    """Forward and backward over the window's micro-batches, clip, and the optimizer step unless the gradient
    norm is not finite. Returns the summed loss of this rank (on the device), the global [trained, tokens,
    squares, stop votes], the grad norm, and whether the update was skipped.

    The one host read of the step is the gradient norm (with the stop votes): the update must not run on a
    non-finite gradient, and every rank must agree on it and on stopping. Everything else stays on the device
    until a logging step."""
    world = accelerator.num_processes
    counts = torch.tensor([*window.counts, float(stop_signal > 0)], dtype=torch.float64)
    denominator = max(window.counts[0], 1.0)  # one process: a Python number, no device round trip
    if world > 1:  # the one collective of the step: every rank needs the window's global trained tokens
        counts = accelerator.reduce(counts.to(accelerator.device, non_blocking=True), reduction="sum")
        denominator = counts[0].clamp(min=1.0).float()  # stays on the device: no host sync
    loss_sum = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(window.batches):
        # Gradients are all-reduced only on the window's last micro-batch; the others accumulate locally
        # under no_sync.
        sync = i == len(window.batches) - 1
        with nullcontext() if sync else accelerator.no_sync(model):
            loss = compute_loss(model, to_device(batch, accelerator.device))
            # DDP and FSDP average gradients over processes, hence the factor `world`: the result is
            # d(sum of all token losses in the window) / (trained tokens in the window).
            accelerator.backward(loss * world / denominator)
        loss_sum += loss.detach()
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf")))  # host sync
    stop = bool(counts[3] > 0) if world > 1 else False  # every rank reads the same global votes
    lr = scheduler.get_last_lr()[0]  # the lr of this update
    skipped = not math.isfinite(grad_norm)  # the global norm: all ranks skip together
    if not skipped:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss_sum": loss_sum, "counts": counts[:3], "grad_norm": grad_norm, "lr": lr, "skipped": skipped,
            "stop": stop}


@torch.no_grad()
def evaluate(model, dataset, accelerator, recipe: Recipe, *, pad: int, on_batch=lambda done, total: None) -> dict:
    """Eval loss, perplexity, token accuracy, and exact match over the eval set (sharded over ranks), with
    the training loss function.

    Exact match counts an example as right when every trained token is the argmax under teacher
    forcing, which is exactly when greedy decoding would reproduce the completion.
    """
    tc = recipe.train
    model.eval()
    by_tokens = tc.micro_batch_tokens if tc.eval_batch_size is None else None
    batches = global_micro_batches(len(dataset), seed=0, epoch=0, world_size=accelerator.num_processes,
                                   micro_batch_size=tc.eval_batch_size or tc.micro_batch_size,
                                   micro_batch_tokens=by_tokens, lengths=dataset["length"] if by_tokens else None,
                                   shuffle=False)
    plan = [g[accelerator.process_index] for g in batches]
    totals = torch.zeros(5, dtype=torch.float64, device=accelerator.device)  # loss, tokens, correct, exact, examples
    for done, window in enumerate(windows(dataset, lambda _: plan, epoch=0, micro=0, steps=len(plan), accum=1,
                                          pad_id=pad, packing=packs_rows(recipe), pin=False)):
        on_batch(done, len(plan))
        cpu_example = window.batches[0]["loss_example"]
        n = int(cpu_example.max()) + 1 if cpu_example.numel() else 0  # examples with a trained token, from the CPU
        batch = to_device(window.batches[0], accelerator.device)
        loss, hits = compute_loss(model, batch, return_hits=True)
        example = batch["loss_example"]
        trained = torch.bincount(example, minlength=n)
        right = torch.bincount(example, weights=hits.double(), minlength=n)
        totals += torch.stack([loss.double(), hits.new_tensor(hits.numel(), dtype=torch.float64),
                               hits.double().sum(), ((right == trained) & (trained > 0)).double().sum(),
                               (trained > 0).double().sum()])
    loss, tokens, correct, exact, examples = global_sum(accelerator, *totals.tolist())
    model.train()
    mean = loss / max(tokens, 1)
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)),
            "eval_token_accuracy": correct / max(tokens, 1), "eval_exact_match": exact / max(examples, 1)}


# --------------------------------------------------------------------------- the loop


def train(recipe: Recipe, *, resume: str | None = None, overwrite: bool = False,
          allow_recipe_change: bool = False) -> dict:
    """Train as the recipe says; returns the summary. The run folder's lock is released however this ends."""
    with ExitStack() as cleanup:
        return _train(recipe, resume=resume, overwrite=overwrite, allow_recipe_change=allow_recipe_change,
                      cleanup=cleanup)


@contextmanager
def deterministic_algorithms():
    """torch's deterministic kernels for this run (train.deterministic), the previous setting restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first runs, which is later
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _train(recipe: Recipe, *, resume: str | None, overwrite: bool, allow_recipe_change: bool, cleanup) -> dict:
    import datasets
    import transformers
    from accelerate.utils import set_seed

    datasets.disable_progress_bars()  # the run's own progress bar is the one to watch
    transformers.utils.logging.disable_progress_bar()
    # peft asks transformers' deprecated is_gradient_checkpointing on every LoRA run: nothing for the user to do
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    tc = recipe.train
    check_trackers(recipe.logging.report_to)  # a missing tracker library fails now, not after the model loads
    accelerator = build_accelerator(recipe)
    out = Path(recipe.output_dir)
    console = RunConsole(enabled=accelerator.is_main_process, progress=recipe.logging.progress)
    cleanup.callback(console.close)
    say = console.say

    # ---- checks that only read: nothing in the run folder changes until every one of them has passed
    done = finished_run(out, recipe, allow_recipe_change=allow_recipe_change) if resume == "auto" else None
    if done is not None:
        say(f"the run in {out} is already complete ({done['steps']} steps, final/ written); nothing "
            "was changed. Raise train.max_steps with --allow-recipe-change to train it further.")
        return done
    ckpt = check_output_dir(accelerator, out, resume=resume, overwrite=overwrite)
    notes = check_resume(ckpt, recipe, world=accelerator.num_processes, fsdp=uses_fsdp(accelerator),
                         allow_recipe_change=allow_recipe_change) if ckpt else []
    if resume and ckpt is None:
        say(f"--resume {resume}: no complete checkpoint in {out}; starting from step 0.")
    set_seed(tc.seed)  # same seed on every rank: identical init, and DDP checks that anyway
    if tc.deterministic:
        cleanup.enter_context(deterministic_algorithms())

    # ---- data: tokenised once on the main process, then read from the cache by the others
    tokenizer = load_tokenizer(recipe.model)
    if (template := read_template(recipe.data)) is not None:  # a file: final/'s tokenizer renders as training did
        tokenizer.chat_template = template
    with accelerator.main_process_first():
        train_ds, eval_ds, stats, cache_hit = prepare_datasets(recipe.data, tokenizer, seed=tc.seed)
    (cache_reads,) = global_sum(accelerator, cache_hit)  # processes that read the cache instead of tokenising
    pad = pad_id(tokenizer)
    world, accum = accelerator.num_processes, tc.grad_accum_steps
    lengths = train_ds["length"]
    _check_budget(recipe, lengths, eval_ds)
    plan = data_plan(recipe, lengths, world=world)
    steps_per_epoch = [math.ceil(len(plan(e)) / accum) for e in range(tc.epochs)]
    total_steps = tc.max_steps or sum(steps_per_epoch)
    s = stats["train"]
    say(
        f"data: {s.examples} train examples ({'tokenised' if cache_reads < world else 'cache hit'}, "
        f"{int(cache_reads)} of {world} processes read the cache), "
        f"{s.truncated} truncated, {s.dropped} dropped, {s.trained_fraction:.1%} of tokens trained; "
        f"eval: {stats['eval'].examples if 'eval' in stats else 0} examples"
    )
    # The cheap part of `llmtrain doctor`: masks, and the stop token is trained (the model learns to stop).
    for name, status, detail in [*check_masks(s, train_on_prompt=recipe.data.train_on_prompt,
                                              text=recipe.data.format == "text", max_seq_len=recipe.data.max_seq_len),
                                 *check_eos_trained(train_ds.select(range(min(200, len(train_ds))))["labels"],
                                                    tokenizer)]:
        if status == "fail":
            raise LLMTrainError(f"{name}: {detail}")
        if status == "warn":
            say(f"warning ({name}): {detail}")
    packing_efficiency = None
    if tc.micro_batch_tokens:
        bins = sum(len(g) - g.count([]) for g in plan(0))
        packing_efficiency = sum(lengths) / (bins * tc.micro_batch_tokens)
        say(f"global batch: bins of <= {tc.micro_batch_tokens} tokens x {accum} accumulation x {world} "
            f"processes; {bins} bins/epoch, packing efficiency {packing_efficiency:.1%} (real tokens / "
            f"budget); {total_steps} steps ({steps_per_epoch[0]}/epoch)")
    else:
        mb = tc.micro_batch_size
        say(f"global batch: {mb} micro-batch x {accum} accumulation x {world} processes = "
            f"{mb * accum * world} examples/step; {total_steps} steps ({steps_per_epoch[0]}/epoch)")

    # ---- model, optimizer, schedule
    model = load_model(recipe.model, recipe.lora, device=accelerator.device, empty=receives_weights(accelerator))
    fused_ce = fused_linear_cross_entropy(recipe.model, accelerator.device)  # None unless liger is in use
    attach_loss(model, chunk=tc.loss_chunk_tokens, fused_linear_ce=fused_ce)
    if recipe.model.compile:
        say(f"compile: {compile_layers(model)} decoder layers (regional torch.compile)")
    n_total, n_trainable = count_parameters(model)
    flops = flop_model(model)
    peak = peak_flops(accelerator.device, recipe.logging.peak_tflops)
    say(f"model: {n_total:,} parameters, {n_trainable:,} trainable ({'LoRA' if recipe.lora else 'full'}); "
        f"attention: {describe_attention(recipe.model)}{'; liger kernels' if fused_ce else ''}")
    # ---- every check passed: take the run folder (lock, --overwrite) and only now write into it
    run_dir = claim_output_dir(accelerator, out, resume=resume, overwrite=overwrite)
    cleanup.callback(run_dir.release)
    if accelerator.is_main_process:
        (out / "recipe.yaml").write_text(recipe.to_yaml())
        console.keep_log(out / "train.log")
    optimizer = build_optimizer(model, lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas, eps=tc.eps,
                                fused=use_fused_adamw(accelerator))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=tc.warmup_steps, total=total_steps, schedule=tc.schedule, min_ratio=tc.min_lr_ratio))
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState(examples_per_micro=0 if tc.micro_batch_tokens else tc.micro_batch_size * world,
                       processes=world, micro_batch_tokens=tc.micro_batch_tokens or 0)
    accelerator.register_for_checkpointing(scheduler, state)
    # Accelerate saves and loads the model it was given, not the DDP wrapper: names carry no "module.".
    unwrapped = accelerator.unwrap_model(model)
    trainable_names = {n for n, p in unwrapped.named_parameters() if p.requires_grad} if recipe.lora else None
    if trainable_names:
        lora_only_hooks(accelerator, trainable_names)
    model_keys = set(unwrapped.state_dict())
    if ckpt is not None:
        load_checkpoint(accelerator, ckpt, trainable_names=trainable_names)
        state.check_layout(accum=accum, micro_batch_tokens=tc.micro_batch_tokens or 0, processes=world)
        say(f"resumed from {ckpt} at step {state.step}")
        if state.processes != world:
            # Each rank restores its own RNG file; with more ranks than saved, the new ones start from the seed.
            say(f"note: written by {state.processes} processes, resumed on {world}: the same examples "
                "per step, but per-rank random streams (dropout) do not replay the original run's.")
            state.processes = world

    trackers = (open_trackers(recipe.logging.report_to, output_dir=out, config=recipe.model_dump(mode="json"),
                              project=recipe.logging.project, run_name=recipe.logging.run_name)
                if accelerator.is_main_process else [])
    log = MetricsLog(out, enabled=accelerator.is_main_process, trackers=trackers,
                     resume_step=state.step if resume else None)
    for note in notes:  # allowed recipe changes at resume (--allow-recipe-change): said, and on record
        say(f"note: {note}")
        log.write({"type": "note", "step": state.step, "note": note})
    progress, task = console.progress(total=total_steps, completed=state.step)
    on_gpu = accelerator.device.type == "cuda"
    model.train()
    stream = prefetch(windows(train_ds, data_plan(recipe, lengths, world=world, rank=accelerator.process_index),
                              epoch=state.epoch, micro=state.micro_in_epoch, steps=total_steps - state.step,
                              accum=accum, pad_id=pad, packing=packs_rows(recipe), pin=on_gpu))
    start, last = time.perf_counter(), {}
    since = {"time": start}  # when the last metrics line was written
    pending = []  # device statistics of the steps since the last metrics line
    evals = []
    with progress, StopRequests() as stop_requests, closing(stream):  # closing: the prefetch thread ends here
        for window in stream:
            step = train_step(model, optimizer, scheduler, accelerator, window, max_grad_norm=tc.max_grad_norm,
                              stop_signal=stop_requests.signum)
            # One process acts on a signal as soon as its step ends; several act on the votes of the step's
            # collective (a signal that lands during a step is voted on in the next one).
            stop = step["stop"] if world > 1 else bool(stop_requests.signum)
            pending.append({**step, "epoch": window.epoch})
            state.step += 1
            state.bad_steps += step["skipped"]  # a count of the whole run: it survives a resume
            if step["skipped"] and state.bad_steps <= tc.max_bad_steps:
                say(f"step {state.step}: gradient norm {step['grad_norm']}, update skipped "
                    f"({state.bad_steps} of train.max_bad_steps={tc.max_bad_steps})")
            # Roll the epoch over with the step that ends it, so a checkpoint saved now resumes at the next
            # epoch's start rather than "all micro-batches into" the finished one.
            state.epoch, state.micro_in_epoch = ((window.epoch + 1, 0) if window.epoch_done
                                                 else (window.epoch, window.end))
            # Eval data is always used: every eval_every_steps steps if set, and at the end in any case.
            eval_now = eval_ds is not None and (
                state.step == total_steps or bool(tc.eval_every_steps and state.step % tc.eval_every_steps == 0))
            save_now = stop or (recipe.checkpoint.every_steps and state.step % recipe.checkpoint.every_steps == 0)
            if (state.step % recipe.logging.every_steps == 0 or state.step == total_steps or eval_now or save_now
                    or step["skipped"]):
                last = _log_line(accelerator, pending, state, since=since, start=start, flops=flops, peak=peak)
                pending = []
                if on_gpu:
                    last["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                    last["max_memory_reserved"] = torch.cuda.max_memory_reserved()
                log.write(last)
                latest_eval = f"  eval {evals[-1]['eval_loss']:.4f}" if evals else ""
                progress.update(task, completed=state.step, info=step_text(last) + latest_eval)
                console.step(last, total=total_steps)
            else:
                progress.update(task, completed=state.step)
            if state.bad_steps > tc.max_bad_steps:  # after its metrics line: the bad step is on record
                diverged(accelerator, out, state.step, step["grad_norm"], tc)
            if eval_now:
                shown = progress.add_task("eval", total=None, info=f"{len(eval_ds)} examples")
                ev = evaluate(model, eval_ds, accelerator, recipe, pad=pad, on_batch=lambda done, total, shown=shown:
                              progress.update(shown, completed=done, total=total))
                progress.remove_task(shown)
                log.write({"type": "eval", "step": state.step, **ev})
                samples = []
                if tc.eval_samples:  # every rank generates (under FSDP each forward gathers all ranks' shards)
                    first = eval_ds.select(range(min(tc.eval_samples, len(eval_ds))))
                    samples = generate_samples(unwrapped, tokenizer, first, max_new_tokens=tc.eval_max_new_tokens,
                                               step=state.step, synced=world > 1)
                log.write_samples(samples)  # the main process writes samples.jsonl
                evals.append({"step": state.step, **ev})
                say(f"step {state.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
                if samples:
                    say(format_sample(samples[0]))
                # loss.png: a failure is said, and training goes on
                if accelerator.is_main_process and (note := update_loss_plot(out)):
                    say(note)
            if save_now:
                check_finite_weights(accelerator, model, state.step)
                saved = save_checkpoint(accelerator, output_dir=out, state=state, recipe_yaml=recipe.to_yaml(),
                                        keep_last=recipe.checkpoint.keep_last, model_keys=model_keys,
                                        trainable=trainable_names)
            if eval_now or save_now:  # tokens/s of the next line counts training only, not this eval or save
                since["time"] = time.perf_counter()
            if stop:
                signum = stop_requests.signum or signal.SIGTERM  # a rank that got no signal stops with its peers
                raise Stopped(f"{signal.Signals(signum).name} at step {state.step}: the checkpoint {saved} is "
                              f"complete. Continue with: llmtrain finetune {out / 'recipe.yaml'} --resume auto "
                              "(under the same accelerate launch, if any).", signum)

    # ---- export and summary
    if recipe.checkpoint.save_final:
        check_finite_weights(accelerator, model, state.step)
        save_final(accelerator, model, tokenizer, out / "final")
    summary = {"steps": state.step, "params_total": n_total, "params_trainable": n_trainable,
               "final_loss": last.get("loss"), "tokens_seen": state.tokens_seen,
               "train_time_s": time.perf_counter() - start, "data": {k: vars(v) for k, v in stats.items()},
               "data_cache_reads": int(cache_reads), "packing_efficiency": packing_efficiency,
               "tokens_per_s_per_gpu": state.tokens_seen / max(time.perf_counter() - start, 1e-9) / world}
    if on_gpu:
        summary.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                       max_memory_reserved=torch.cuda.max_memory_reserved(),
                       **predicted_for_run(recipe, accelerator))
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(strict_json(summary), indent=1, allow_nan=False))
        summary_shown = {**summary, "final": str(out / "final") if recipe.checkpoint.save_final else None}
        say(summary_table(summary_shown, out=out, evals=evals))
        final = summary["final_loss"]
        say(f"done: {state.step} steps, final loss {final if final is None else round(final, 4)}, wrote {out}")
    log.close()
    if accelerator.is_main_process and (note := update_loss_plot(out)):
        say(note)
    accelerator.end_training()
    return summary


def _log_line(accelerator, pending: list[dict], state: TrainState, *, since: dict, start: float,
              flops, peak: float | None) -> dict:
    """Read back the steps since the last line (the host sync of a logging step) and build the metrics line:
    the last step's loss, grad norm and tokens; speed and MFU over all steps since the last line."""
    world = accelerator.num_processes
    counts = torch.stack([p["counts"].cpu() for p in pending])  # [steps, 3]: trained, tokens, squares (global)
    losses = global_sum(accelerator, *(p["loss_sum"].item() for p in pending))
    for trained, tokens, _ in counts.tolist():
        state.tokens_seen += int(tokens)
        state.trained_tokens_seen += int(trained)
    trained, tokens, _ = counts[-1].tolist()
    now = time.perf_counter()
    window_counts = counts.sum(0)
    dt = now - since["time"]
    since["time"] = now
    tokens_per_s = float(window_counts[1]) / dt
    model_flops = flops.step(*(float(x) for x in (window_counts[1], window_counts[0], window_counts[2])))
    return {"type": "train", "step": state.step, "epoch": pending[-1]["epoch"], "loss": losses[-1] / max(trained, 1),
            "lr": pending[-1]["lr"], "grad_norm": pending[-1]["grad_norm"], "skipped": pending[-1]["skipped"],
            "tokens": int(tokens), "trained_tokens": int(trained),
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / world,
            "tflops_per_gpu": model_flops / dt / world / 1e12,
            "mfu": model_flops / dt / world / peak if peak else None,
            "tokens_seen": state.tokens_seen, "elapsed_s": now - start}


def _check_budget(recipe: Recipe, lengths: list[int], eval_ds) -> None:
    """With a token budget, every example must fit in one micro-batch: refuse at start-up, never drop."""
    budget = recipe.train.micro_batch_tokens
    if budget is None:
        return
    longest = max(max(lengths, default=0), max(eval_ds["length"], default=0) if eval_ds is not None else 0)
    if longest > budget:
        raise LLMTrainError(
            f"train.micro_batch_tokens={budget} is smaller than the longest example ({longest} tokens); no example "
            f"is ever split or dropped. Raise train.micro_batch_tokens to at least {longest}, or truncate the "
            f"examples with data.max_seq_len={budget}."
        )
