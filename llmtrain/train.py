"""The training loop. `train(recipe)` reads top to bottom: set up, load data and model, loop, save.

Loss normalisation: the loss of an optimizer step is the sum of token losses over every micro-batch
of the accumulation window on every process, divided by the number of trained tokens in that whole
window. So micro-batch 8 x accumulation 1, micro-batch 1 x accumulation 8 and 2 processes x micro-batch
4 all give the same loss and the same gradient, however the tokens are spread over the examples.
"""

from __future__ import annotations

import functools
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from llmtrain.batching import collate, rank_micro_batches
from llmtrain.checkpoint import TrainState, load_checkpoint, lora_only_hooks, save_checkpoint
from llmtrain.config import Recipe
from llmtrain.data import IGNORE, prepare_datasets
from llmtrain.distributed import build_accelerator, global_sum, receives_weights, use_fused_adamw, uses_fsdp
from llmtrain.errors import LLMTrainError
from llmtrain.export import save_final
from llmtrain.metrics import MetricsLog, progress_bar, step_info
from llmtrain.modeling import build_optimizer, count_parameters, load_model, load_tokenizer, pad_id
from llmtrain.rundir import prepare_output_dir

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


def compute_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of token cross-entropies over the batch; the caller normalises."""
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    # use_cache=False matters for packing: with a KV cache transformers skips the detection of restarted
    # position ids, and packed examples would attend to each other.
    logits = model(**inputs, use_cache=False).logits
    # Cross-entropy in fp32: bf16 log-softmax over a 32k vocabulary loses digits the loss needs.
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE,
                           reduction="sum")


def _batches(dataset, index_lists, *, device, pad: int, packing: bool):
    """Collated micro-batches on `device`, each with its number of input tokens of real examples (an idle
    rank's placeholder row is not data and counts 0)."""
    for idx in index_lists:
        rows = dataset[idx] if idx else {"input_ids": [], "labels": []}
        examples = [{"input_ids": i, "labels": lab} for i, lab in zip(rows["input_ids"], rows["labels"])]
        batch = collate(examples, pad_id=pad, packing=packing)
        yield {k: v.to(device) for k, v in batch.items()}, sum(len(e["input_ids"]) for e in examples)


@torch.no_grad()
def evaluate(model, dataset, accelerator, *, batch_size: int, pad: int) -> dict:
    """Eval loss, perplexity, token accuracy, and exact match over the eval set (sharded over ranks).

    Exact match counts an example as right when every trained token is the argmax under teacher
    forcing, which is exactly when greedy decoding would reproduce the completion.
    """
    model.eval()
    index_lists = rank_micro_batches(len(dataset), seed=0, epoch=0, micro_batch_size=batch_size,
                                     rank=accelerator.process_index, world_size=accelerator.num_processes,
                                     shuffle=False)
    loss = tokens = correct = exact = examples = 0.0
    for batch, _ in _batches(dataset, index_lists, device=accelerator.device, pad=pad, packing=False):
        logits = model(**{k: v for k, v in batch.items() if k != "targets"}).logits.float()
        targets = batch["targets"]
        mask = targets != IGNORE
        loss += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum").item()
        hit = (logits.argmax(-1) == targets) & mask
        tokens += mask.sum().item()
        correct += hit.sum().item()
        real = mask.any(-1)
        exact += ((hit | ~mask).all(-1) & real).sum().item()
        examples += real.sum().item()
    loss, tokens, correct, exact, examples = global_sum(accelerator, loss, tokens, correct, exact, examples)
    model.train()
    mean = loss / max(tokens, 1)
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)),
            "eval_token_accuracy": correct / max(tokens, 1), "eval_exact_match": exact / max(examples, 1)}


# --------------------------------------------------------------------------- the loop


def train(recipe: Recipe, *, resume: str | None = None, overwrite: bool = False) -> dict:
    from accelerate.utils import set_seed

    import datasets
    import transformers

    datasets.disable_progress_bars()  # the run's own progress bar is the one to watch
    transformers.utils.logging.disable_progress_bar()
    tc = recipe.train
    accelerator = build_accelerator(recipe)
    out = Path(recipe.output_dir)
    ckpt = prepare_output_dir(accelerator, out, resume=resume, overwrite=overwrite)
    if resume and ckpt is None:
        accelerator.print(f"--resume {resume}: no complete checkpoint in {out}; starting from step 0.")
    if accelerator.is_main_process:
        (out / "recipe.yaml").write_text(recipe.to_yaml())
    set_seed(tc.seed)  # same seed on every rank: identical init, and DDP checks that anyway

    # ---- data: tokenised once on the main process, then read from the cache by the others
    tokenizer = load_tokenizer(recipe.model)
    with accelerator.main_process_first():
        train_ds, eval_ds, stats, cache_hit = prepare_datasets(recipe.data, tokenizer, seed=tc.seed)
    (cache_reads,) = global_sum(accelerator, cache_hit)  # processes that read the cache instead of tokenising
    pad = pad_id(tokenizer)
    world, mb, accum = accelerator.num_processes, tc.micro_batch_size, tc.grad_accum_steps
    micro_per_epoch = math.ceil(len(train_ds) / (mb * world))
    steps_per_epoch = math.ceil(micro_per_epoch / accum)
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    s = stats["train"]
    accelerator.print(
        f"data: {s.examples} train examples ({'tokenised' if cache_reads < world else 'cache hit'}, "
        f"{int(cache_reads)} of {world} processes read the cache), "
        f"{s.truncated} truncated, {s.dropped} dropped, {s.trained_fraction:.1%} of tokens trained; "
        f"eval: {stats['eval'].examples if 'eval' in stats else 0} examples"
    )
    accelerator.print(f"global batch: {mb} micro-batch x {accum} accumulation x {world} processes = "
                      f"{mb * accum * world} examples/step; {total_steps} steps ({steps_per_epoch}/epoch)")

    # ---- model, optimizer, schedule
    model = load_model(recipe.model, recipe.lora, device=accelerator.device, empty=receives_weights(accelerator))
    n_total, n_trainable = count_parameters(model)
    accelerator.print(f"model: {n_total:,} parameters, {n_trainable:,} trainable ({'LoRA' if recipe.lora else 'full'})")
    optimizer = build_optimizer(model, lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas, eps=tc.eps,
                                fused=use_fused_adamw(accelerator))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=tc.warmup_steps, total=total_steps, schedule=tc.schedule, min_ratio=tc.min_lr_ratio))
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState(examples_per_micro=mb * world, processes=world)
    accelerator.register_for_checkpointing(scheduler, state)
    # Accelerate saves and loads the model it was given, not the DDP wrapper: names carry no "module.".
    unwrapped = accelerator.unwrap_model(model)
    trainable_names = {n for n, p in unwrapped.named_parameters() if p.requires_grad} if recipe.lora else None
    if trainable_names:
        lora_only_hooks(accelerator, trainable_names)
    model_keys = set(unwrapped.state_dict())
    if ckpt is not None:
        load_checkpoint(accelerator, ckpt, trainable_names=trainable_names)
        state.check_layout(examples_per_micro=mb * world, accum=accum)
        accelerator.print(f"resumed from {ckpt} at step {state.step}")
        if state.processes != world:
            # Each rank restores its own RNG file; with more ranks than saved, the new ones start from the seed.
            accelerator.print(f"note: written by {state.processes} processes, resumed on {world}: the same examples "
                              "per step, but per-rank random streams (dropout) do not replay the original run's.")
            state.processes = world

    log = MetricsLog(out, enabled=accelerator.is_main_process, tensorboard=recipe.logging.tensorboard,
                     resume_step=state.step if resume else None)
    progress, task = progress_bar(enabled=recipe.logging.progress and accelerator.is_main_process,
                                  total=total_steps, completed=state.step)
    on_gpu = accelerator.device.type == "cuda"
    model.train()
    start, last = time.perf_counter(), {}
    with progress:
        while state.step < total_steps:
            micro = rank_micro_batches(len(train_ds), seed=tc.seed, epoch=state.epoch, micro_batch_size=mb,
                                       rank=accelerator.process_index, world_size=world)
            while state.micro_in_epoch < len(micro) and state.step < total_steps:
                t0 = time.perf_counter()
                window = micro[state.micro_in_epoch : state.micro_in_epoch + accum]  # one optimizer step
                batches, counts = zip(*_batches(train_ds, window, device=accelerator.device, pad=pad,
                                                packing=recipe.data.packing))
                local_trained = sum(int((b["targets"] != IGNORE).sum()) for b in batches)
                local_tokens = sum(counts)
                trained, tokens = global_sum(accelerator, local_trained, local_tokens)
                loss_sum = torch.zeros((), device=accelerator.device)
                for i, batch in enumerate(batches):
                    # Gradients are all-reduced only on the window's last micro-batch; the others
                    # accumulate locally under no_sync.
                    sync = i == len(batches) - 1
                    with nullcontext() if sync else accelerator.no_sync(model):
                        loss = compute_loss(model, batch)
                        # DDP and FSDP average gradients over processes, hence the factor `world`:
                        # the result is d(sum of all token losses in the window) / (trained tokens).
                        accelerator.backward(loss * world / max(trained, 1.0))
                    loss_sum += loss.detach()
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), tc.max_grad_norm or float("inf"))
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                (loss_total,) = global_sum(accelerator, loss_sum.item())
                state.step += 1
                state.micro_in_epoch += len(batches)
                state.tokens_seen += int(tokens)
                state.trained_tokens_seen += int(trained)
                dt = time.perf_counter() - t0
                last = {"type": "train", "step": state.step, "epoch": state.epoch, "loss": loss_total / max(trained, 1),
                        "lr": lr, "grad_norm": float(grad_norm), "tokens": int(tokens), "trained_tokens": int(trained),
                        "tokens_per_s": tokens / dt, "tokens_seen": state.tokens_seen,
                        "elapsed_s": time.perf_counter() - start}
                if on_gpu:
                    last["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                    last["max_memory_reserved"] = torch.cuda.max_memory_reserved()
                log.write(last)
                progress.update(task, completed=state.step, info=step_info(last))

                if eval_ds is not None and tc.eval_every_steps and (
                        state.step % tc.eval_every_steps == 0 or state.step == total_steps):
                    ev = evaluate(model, eval_ds, accelerator, batch_size=tc.eval_batch_size or mb, pad=pad)
                    log.write({"type": "eval", "step": state.step, **ev})
                    if accelerator.is_main_process:
                        progress.console.print(f"step {state.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
                if recipe.checkpoint.every_steps and state.step % recipe.checkpoint.every_steps == 0:
                    save_checkpoint(accelerator, output_dir=out, state=state, recipe_yaml=recipe.to_yaml(),
                                    keep_last=recipe.checkpoint.keep_last, model_keys=model_keys,
                                    trainable=trainable_names)
            if state.micro_in_epoch >= len(micro):
                state.epoch, state.micro_in_epoch = state.epoch + 1, 0

    # ---- export and summary
    if recipe.checkpoint.save_final:
        save_final(accelerator, model, tokenizer, out / "final")
    summary = {"steps": state.step, "params_total": n_total, "params_trainable": n_trainable,
               "final_loss": last.get("loss"), "tokens_seen": state.tokens_seen,
               "train_time_s": time.perf_counter() - start, "data": {k: vars(v) for k, v in stats.items()},
               "data_cache_reads": int(cache_reads)}
    if on_gpu:
        summary.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                       max_memory_reserved=torch.cuda.max_memory_reserved(),
                       **_predicted_memory(recipe, accelerator))
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        accelerator.print(f"done: {state.step} steps, final loss {summary['final_loss']}, wrote {out}")
    log.close()
    accelerator.end_training()
    return summary


def _predicted_memory(recipe: Recipe, accelerator) -> dict:
    """The estimator's prediction for this very run, logged beside the measured peak."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from llmtrain.memory import estimate_for_recipe

    fsdp = uses_fsdp(accelerator)
    strategy = "fsdp" if fsdp else ("ddp" if accelerator.num_processes > 1 else "single")
    offload = fsdp and isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
    try:
        est = estimate_for_recipe(recipe, num_processes=accelerator.num_processes, strategy=strategy,
                                  cpu_offload=offload)
    except LLMTrainError as e:  # a model the estimator cannot read must not fail a finished run
        accelerator.print(f"memory estimate unavailable: {e}")
        return {}
    # allocated/reserved compare with torch.cuda.max_memory_*; peak adds the CUDA context and NCCL buffers.
    return {"predicted_peak_bytes": est.per_gpu_peak_bytes,
            "predicted_peak_allocated_bytes": est.per_gpu_peak_allocated_bytes,
            "predicted_peak_reserved_bytes": est.per_gpu_peak_reserved_bytes, "predicted_breakdown": est.breakdown}
