"""Exportable models: <output_dir>/final (full model or PEFT adapter) and merged LoRA models.

`final/` is kept apart from the resume checkpoints: it is what people load with
`AutoModelForCausalLM.from_pretrained` (full fine-tune) or `PeftModel.from_pretrained` (LoRA).
"""

from __future__ import annotations

import signal
import shutil
import tempfile
import threading
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.parallel.collectives import on_main
from llmtrain.run.checkpoint import write_failure
from llmtrain.run.rundir import cannot_create


def save_final(accelerator, model, tokenizer, path: Path, *, state_dict: dict | None = None,
               end_ids: list[int] = ()) -> None:
    """Write safetensors weights (or the adapter) and the tokenizer, via a temporary folder. `state_dict`: the whole
    model's, already gathered (pipeline stages: parallel/pipeline.gather_state_dict); `end_ids`: the template's end of
    turn (objective.end_of_turn_ids), listed in a whole model's generation_config.json (ends_turns)."""
    # get_state_dict gathers sharded (FSDP) weights, so every rank must call it.
    state_dict = accelerator.get_state_dict(model) if state_dict is None else state_dict

    def save():
        from safetensors import SafetensorError

        tmp = path.with_name(path.name + ".tmp")
        try:
            write(tmp)
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: said as a checkpoint's failure is
            shutil.rmtree(tmp, ignore_errors=True)
            raise LLMTrainError(
                f"writing {path.name}/ in {path.parent} failed: {write_failure(e, path.parent)}. The run stopped "
                f"after its last step; what was written of {path.name}/ was removed and the checkpoints are intact. "
                f"Free disk space, then continue with --resume auto: from a checkpoint at the last step it writes "
                f"{path.name}/ alone (from an earlier one it trains the steps after it again).") from e

    def write(tmp: Path):
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        # an adapter of a grown vocabulary (model.new_tokens): peft would add the base's resized embeddings and head
        # (two more copies of each); modules_to_save's trained copies are the model, and every loader grows the base
        adapter = {"save_embedding_layers": False} if hasattr(unwrapped, "peft_config") else {}
        unwrapped.save_pretrained(tmp, state_dict=tied_once(state_dict, unwrapped), safe_serialization=True,
                                  **adapter)
        tokenizer.save_pretrained(tmp)
        ends_turns(tmp, end_ids)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)

    on_main(accelerator, save)  # the others wait for it (and get its error, should it fail)


def ends_turns(folder: Path, end_ids) -> None:
    """A whole model's generation_config.json lists `end_ids` (the chat template's end of turn, one token) among its
    eos_token_id, after the ids it had: transformers' generate, pipelines and servers that read it stop where the run
    trained replies to end. A base model trained with a chat template (Qwen3-Base with its ChatML, <|im_end|>) lists
    only its EOS, and ran on past every reply. An adapter's folder has no generation config: its base's applies
    (`llmtrain export --merge` writes the merged model's with these ids)."""
    file = folder / "generation_config.json"
    if not end_ids or not file.is_file():
        return
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(folder)
    had = config.eos_token_id if isinstance(config.eos_token_id, list) else \
        [] if config.eos_token_id is None else [config.eos_token_id]
    if (ids := list(dict.fromkeys([*had, *end_ids]))) != had:
        config.eos_token_id = ids
        config.save_pretrained(folder)


def tied_once(state: dict, model) -> dict:
    """A tied embedding (Llama 3.2, small Qwen3, Gemma 3) saved once, under the embedding's name, as one process's
    save_pretrained writes the one weight (transformers ties the head to it on loading). A gathered state dict (FSDP's
    get_state_dict, the pipeline's stages) holds the head as a tensor of its own, equal to the embedding, which
    save_pretrained would write a second time (Gemma 3's 262K x 2,560 embedding: 1.3 GB more in bf16)."""
    from llmtrain.model.loss import causal_lm

    if not getattr(causal_lm(model).config.get_text_config(), "tie_word_embeddings", False):
        return state
    embeds = [k for k in state if k.endswith("embed_tokens.weight")]
    return {k: v for k, v in state.items() if not (embeds and k.endswith("lm_head.weight"))}


def export_merged(run_dir: Path, out: Path | None = None, *, say=lambda text: None) -> Path:
    """Merge a LoRA run's final adapter into its base model and save a full model. The base is read again from
    model.name_or_path in model.dtype, unquantised even after a QLoRA run (merging into a dequantised 4-bit copy
    would bake the quantisation error into every weight)."""
    import transformers

    from llmtrain.objectives.objective import end_of_turn_ids
    from llmtrain.run.checkpoint import MANIFEST
    from llmtrain.run.replies import unsaved_base
    from llmtrain.run.rundir import run_folder, run_recipe

    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards": say() says it
    run_dir = run_folder(run_dir)  # RUN/final too, as generate and eval take it (it had been refused; audit 39)
    final = run_dir / "final"
    if (run_dir / MANIFEST).is_file():  # a checkpoint (checkpoints/step_N): a recipe.yaml too, and no final/
        raise LLMTrainError(f"'{run_dir}' is a checkpoint; --merge takes the run's output_dir "
                            f"('{run_dir.parent.parent}'), whose final/ holds the adapter the run finished with. A "
                            f"checkpoint's replies: `llmtrain generate {run_dir}`.")
    if not (run_dir / "recipe.yaml").is_file():
        there = "does not exist" if not run_dir.exists() else "is not a run's folder (it has no recipe.yaml)"
        raise LLMTrainError(f"'{run_dir}' {there}: --merge takes a LoRA run's output_dir (runs/NAME), whose final/ "
                            "holds the adapter.")
    if not final.is_dir():  # (it had been called a full fine-tune's)
        raise LLMTrainError(no_final(run_dir))
    if not (final / "adapter_config.json").is_file():
        raise LLMTrainError(
            f"'{final}' holds no LoRA adapter (adapter_config.json). --merge needs a finished LoRA run; "
            "a full fine-tune's final/ is already a complete model."
        )
    recipe = run_recipe(run_dir)  # its base found from any directory
    model = recipe.model
    if problem := unsaved_base(model, str(run_dir)):
        raise LLMTrainError(problem)
    out = out or run_dir / "final-merged"
    if out.exists():
        raise LLMTrainError(f"'{out}' already exists; remove it or pass --out <new folder>.")
    owned = [run_dir.resolve() / d for d in ("final", "checkpoints")]
    if any(o in (p := out.resolve(), *p.parents) for o in owned):  # (a resume's pruning or final/ rewrite deletes it)
        raise LLMTrainError(f"--out '{out}' lies inside the run's final/ or checkpoints/, which the run itself "
                            f"rewrites and prunes (a resume would delete it): give a folder beside them, e.g. "
                            f"{run_dir / 'final-merged'}.")
    if problem := cannot_create(out, "--out"):
        raise LLMTrainError(problem)
    from safetensors import SafetensorError

    made = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()][1:]  # the folders above it
    tmp = _beside(out)  # made before the merge: a folder the system refuses is said at once (/proc had a traceback)
    try:
        stop = signal.signal(signal.SIGTERM, _stopped) if threading.current_thread() is threading.main_thread() \
            else None  # a preemption's SIGTERM, as Ctrl-C: nothing half-written is left (it had left the folder)
        merged, tokenizer = _merge(recipe, final, say)
        try:
            merged.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            # the end of turn as the run trained it: its template is final/'s tokenizer's (a data.chat_template's)
            data = recipe.data.model_copy(update={"chat_template": recipe.data.chat_template is not False})
            ends_turns(tmp, end_of_turn_ids(recipe.model_copy(update={"data": data}), tokenizer))
            tmp.rename(out)
        except (OSError, SafetensorError) as e:  # a full disk (safetensors' own error), a folder that vanished
            said = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e)
            raise LLMTrainError(f"writing the merged model to '{out}' failed ({said}); nothing was left there. Free "
                                "space or give another --out.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # the folders above --out this call made, emptied again (nearest first)
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        if stop is not None:
            signal.signal(signal.SIGTERM, stop)
    # a reward model's is a sequence classifier: AutoModelForCausalLM reads it with a random LM head (audit 39)
    loader = "SequenceClassification" if recipe.reward_model is not None else "CausalLM"
    say(f"merged {final} (a LoRA adapter) into its base model: a whole model in {out}, which transformers' "
        f"AutoModelFor{loader}.from_pretrained loads without peft")
    return out


def _stopped(signum, frame):
    raise KeyboardInterrupt  # the export's cleanup runs, then the command's stop message


def _beside(out: Path) -> Path:
    """A new folder of its own beside `out` (never a folder of the user's), renamed to it once written: a stop
    leaves no `out`. A place the system refuses (a folder of /proc) is one paragraph."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise LLMTrainError(f"--out '{out}' cannot be created: {e.strerror or e} ({e.filename}). Give a folder on a "
                            "writable disk.") from None


def _merge(recipe, final: Path, say):
    """The run's adapter (final/) merged into its base read again in the recipe's dtype, and final/'s tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtrain.model.modeling import _quiet_new_head, grow_vocabulary, pretrained, read_adapter

    model = recipe.model
    dtype = getattr(torch, model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    if recipe.reward_model is not None:  # a reward model: its base under the one-output score head the
        # adapter saved whole; the pad token it scored with (the tokenizer's, else EOS), as objective_for set it
        from transformers import AutoModelForSequenceClassification

        with _quiet_new_head(True):  # its new score head and unused lm_head: the adapter holds the trained head
            base = pretrained(AutoModelForSequenceClassification, model.name_or_path, num_labels=1, dtype=dtype,
                              rope_scaling=model.rope_scaling)
        base.config.get_text_config().pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                                       else tokenizer.eos_token_id)
    else:
        base = pretrained(AutoModelForCausalLM, model.name_or_path, dtype=dtype,  # a text model, its RoPE as trained
                          rope_scaling=model.rope_scaling)
    if model.quantize:
        say(f"the adapter was trained on {'an' if model.quantize == 'nf4' else 'a'} {model.quantize} 4-bit base; it "
            "is merged into the unquantised base read "
            f"from {model.name_or_path} in {model.dtype}, not a dequantised copy.")
    grow_vocabulary(base, len(tokenizer))  # model.new_tokens: the rows the adapter's copies of them hold
    return read_adapter(base, str(final)).merge_and_unload(), tokenizer


def no_final(run_dir: Path) -> str:
    """What --merge says of a run without final/: a run that finished without writing it (checkpoint.save_final:
    false), whose checkpoints --merge does not read, or one that has not finished."""
    from llmtrain.run.rundir import final_removed, finished_without_final, step_dirs

    steps = step_dirs(run_dir / "checkpoints")
    replies = f" (`llmtrain generate {steps[-1]}` replies from its last checkpoint)" if steps else ""
    if finished_without_final(run_dir):
        return (f"'{run_dir}' finished with checkpoint.save_final: false, so it has no final/ to merge: --merge reads "
                f"the adapter a LoRA run's final/ holds, not a checkpoint. Train it with checkpoint.save_final: true"
                f"{replies}.")
    if gone := final_removed(run_dir):
        return f"{gone}; --merge reads the adapter in final/{replies}."
    return (f"'{run_dir}' has no final/ to merge: the run has not finished. Finish it with `llmtrain finetune "
            f"{run_dir}/recipe.yaml --resume auto`, which writes final/{replies}.")
