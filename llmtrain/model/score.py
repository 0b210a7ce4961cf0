"""A reward model's scores, padding-free: the one-output head applied to the last token of each sequence only.

transformers' *ForSequenceClassification forward applies the head to every token of a padded batch and keeps the
rightmost one that is not the pad token. `attach_score` gives the model a forward that, called with `score_index`
(the flat position of each sequence's scored token in the packed or padded micro-batch, batching's layout), runs the
decoder, gathers those rows of the final hidden states and applies the head to them alone: [sequences] scores, the
same numbers up to rounding (the head's matmul on the gathered rows has another shape: 2.4e-7 apart on the tiny
model, audit 9), with no [tokens x 1] tensor. It
runs inside the model's own forward, so DDP and FSDP see one ordinary call. Called without `score_index`, it is
transformers' own forward (export, scoring a saved model).

`scored_position` is that token as transformers picks it: the last one that is not the pad token (a tokenizer
whose pad token is its EOS thus scores the token before a final EOS, as TRL's RewardTrainer then does), so a saved
model scores a padded batch exactly as it trained.
"""

from __future__ import annotations

import types

import torch


def scored_position(ids: list[int], pad_id: int | None) -> int:
    """The index in `ids` of the token a sequence's score is read at: the last that is not `pad_id` (the last token
    when every one is, or when the model has no pad token), as transformers' sequence classification reads it."""
    if pad_id is not None:
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] != pad_id:
                return i
    return len(ids) - 1


def classifier(model):
    """The transformers *ForSequenceClassification module inside `model` (which may be a peft model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_weight(model) -> torch.Tensor:
    """The weight the score head applies: under LoRA peft's trained copy (modules_to_save), which its wrapper
    registers after the original."""
    return [m for m in classifier(model).score.modules() if isinstance(m, torch.nn.Linear)][-1].weight


def attach_score(model) -> None:
    """Give the *ForSequenceClassification module a forward that returns {"scores": [sequences]} when called with
    `score_index` (see the module's docstring)."""
    seq_cls = classifier(model)
    original = type(seq_cls).forward

    def forward(self, *args, score_index=None, **kwargs):
        if score_index is None:
            return original(self, *args, **kwargs)
        kwargs.pop("labels", None)  # peft passes labels=None through
        kwargs.pop("use_cache", None)
        hidden = self.model(*args, use_cache=False, **kwargs).last_hidden_state.flatten(0, 1)
        # sum over the one output, not squeeze: a view as the module's output makes FSDP2 warn, on every process and
        # step, of wrong gradients should an in-place op follow (none does; audit 57). The same values, exactly.
        return {"scores": self.score(hidden[score_index]).float().sum(-1)}

    seq_cls.forward = types.MethodType(forward, seq_cls)


# What the patched forward takes from a collated batch.
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "score_index")


def sequence_scores(model, batch: dict) -> torch.Tensor:
    """The score of every sequence of a collated batch on the device (fp32, in batch order). `cu_seq_lens` /
    `max_length` (packed rows) go to the varlen attention as in loss.py. A sequence-parallel slice
    (parallel/sequence/shards.py) scores the sequences whose last token it holds (`score_sequence`) and gives the
    others 0, for the group's sum."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if "cu_seq_lens" in batch:
        inputs.update(cu_seq_lens_q=batch["cu_seq_lens"], cu_seq_lens_k=batch["cu_seq_lens"],
                      max_length_q=batch["max_length"], max_length_k=batch["max_length"])
    scores = model(**inputs)["scores"]
    if "score_sequence" in batch:
        scores = scores.new_zeros(batch["sequences"]).index_add(0, batch["score_sequence"], scores)
    return scores


# --------------------------------------------------------------------------- a trained reward model, for online RL


def check_reward_folder(path: str) -> None:
    """Refuse, before any weight is read, a folder that is not a reward model: not there, no config.json (nor a
    LoRA adapter's adapter_config.json), a causal LM or another architecture without a sequence-classification
    head, a head with other than one output, or a LoRA adapter of a causal LM."""
    import json
    from pathlib import Path

    from llmtrain.errors import LLMTrainError

    folder = Path(path).expanduser()
    fix = ("rl.rewards: type reward_model reads a reward model: the final/ folder of a run with a reward_model: "
           "section (docs/reward-models.md), or another one-output sequence-classification model")
    if folder.is_file():
        raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) is a file; give the folder that "
                            f"holds it{f' ({folder.parent})' if folder.parent != Path('.') else ''}. {fix}.")
    if not folder.is_dir():
        raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) does not exist. {fix}.")
    if (folder / "summary.json").is_file() and (folder / "final").is_dir():  # a run's folder, not its model
        raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) is a run's folder; its model is "
                            f"{folder / 'final'}: set path: {folder / 'final'}. {fix}.")
    if (folder / "adapter_config.json").is_file():
        task = json.loads((folder / "adapter_config.json").read_text()).get("task_type")
        if task != "SEQ_CLS":
            raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) holds a LoRA adapter of task "
                                f"{task}, not SEQ_CLS: it has no score head. {fix}.")
        outputs = adapter_head_outputs(folder)
        if outputs not in (None, 1):  # (a 2-label classifier's adapter had died in peft's shape check)
            raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) holds a LoRA adapter whose "
                                f"classification head has {outputs} outputs; a reward model has one, its score. "
                                f"{fix}.")
        return
    if not (folder / "config.json").is_file():
        raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) has no config.json (nor a LoRA "
                            f"adapter_config.json). {fix}.")
    config = json.loads((folder / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        held = ", ".join(architectures) or "model"
        raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) holds a {held} "
                            f"with no sequence-classification head to score a completion with (a causal LM is a "
                            f"policy, not a reward model). {fix}.")
    outputs = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if outputs != 1:
        raise LLMTrainError(f"the reward model folder '{path}' (rl.rewards path:) has a classification head with "
                            f"{outputs} outputs; a reward model has one, its score. {fix}.")


def adapter_head_outputs(folder) -> int | None:
    """The rows of the head a SEQ_CLS adapter saves whole (peft's modules_to_save: `score`, or `classifier`), read off
    the safetensors header (no weights read); None where there is none to read."""
    from safetensors import safe_open

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    try:
        with safe_open(str(weights), framework="pt") as f:
            heads = [f.get_slice(k).get_shape() for k in f.keys()
                     if k.endswith(("score.weight", "classifier.weight"))]
    except Exception:  # a damaged file: said when it loads (modeling.readable)
        return None
    return heads[0][0] if heads else None


def load_reward_model(path: str, device):
    """The reward model of `path` (checked by check_reward_folder: a full model, or a SEQ_CLS LoRA adapter on its
    base) and its tokenizer, in eval mode, frozen, on `device`, in the dtype it was saved in; a QLoRA run's adapter on
    its base in 4 bits as the run held it (config.adapter_quantization), so it scores as its evals measured it."""
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.model.modeling import every_process_reads, pretrained

    folder = Path(path).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    with every_process_reads():  # never prepared by FSDP: each process reads its own whole copy
        if (folder / "adapter_config.json").is_file():
            from llmtrain.config import ModelConfig, adapter_base, adapter_quantization
            from llmtrain.model.modeling import (_quiet_new_head, compute_dtype, grow_vocabulary, load_adapter,
                                                 load_model)

            if (held := adapter_quantization(folder)) is not None:  # QLoRA: the 4-bit base it trained and scored on
                quantize, dtype, precision = held
                cfg = ModelConfig(name_or_path=adapter_base(folder), quantize=quantize, dtype=dtype,
                                  attn_implementation="sdpa")  # right-padded batches with their mask
                model = load_model(cfg, None, device=torch.device(device), reward_head=True,
                                   compute_dtype=compute_dtype(precision, device))
            else:
                with _quiet_new_head(True):  # the new score head and the unread LM head: expected
                    model = pretrained(AutoModelForSequenceClassification, adapter_base(folder), num_labels=1,
                                       dtype="auto")
            grow_vocabulary(model, len(tokenizer))  # model.new_tokens: the rows the adapter's copy holds
            model = load_adapter(model, str(folder))
        else:
            held = None
            from llmtrain.model.modeling import readable

            with readable(folder, "reward model (rl.rewards path:)"):
                model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype="auto")
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:  # a completion with a token past the embeddings: an IndexError mid-run, said now
        from llmtrain.errors import LLMTrainError

        raise LLMTrainError(f"the reward model '{path}' (rl.rewards path:) has a tokenizer of {len(tokenizer):,} "
                            f"tokens and embeddings of {rows:,}: a completion holding a token id from {rows:,} on "
                            "cannot be scored. Save it with the tokenizer it was trained with, or with its embeddings "
                            "resized to the tokenizer (model.resize_token_embeddings(len(tokenizer))).")
    model.requires_grad_(False)
    return (model if held is not None else model.to(device)).eval(), tokenizer  # (4-bit: loaded on its device)
