"""The teacher of on-policy distillation (distill.teacher): checked against the student's vocabulary, then loaded
frozen.

The divergence compares the two models' next-token distributions id by id, so the teacher must give the same id
the same meaning: the same vocabulary size (TRL checks this much) and, where the teacher folder has a tokenizer, the
same tokens at the same ids (a size that matches by chance would train the student towards the wrong tokens).
"""

from __future__ import annotations

import torch

from llmtrain.capabilities import scorer_problem
from llmtrain.config import ModelConfig, Recipe, run_folder_problem
from llmtrain.errors import LLMTrainError
from llmtrain.model.modeling import embedding_rows, load_model, weights_problem


def teacher_config(recipe: Recipe) -> ModelConfig:
    """The teacher as model.name_or_path is loaded: the student's attention and trust_remote_code; stored in the
    autocast dtype under mixed precision (a frozen model needs no fp32 master weights), else in model.dtype; none
    of the student's memory savers (they trade compute for the memory of a backward the teacher never runs)."""
    m, precision = recipe.model, recipe.train.mixed_precision
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, m.dtype) if m.dtype == "float32" else m.dtype
    return ModelConfig(name_or_path=recipe.distill.teacher, dtype=dtype, attn_implementation=m.attn_implementation,
                       kernels=m.kernels, trust_remote_code=m.trust_remote_code)


def vocabulary_problem(recipe: Recipe, tokenizer) -> str | None:
    """Why the teacher cannot teach this student (one paragraph), or None. Reads the teacher's config.json and
    tokenizer only: no weights."""
    from transformers import AutoConfig, AutoTokenizer

    from llmtrain.hub import missing_local

    path, trust = recipe.distill.teacher, recipe.model.trust_remote_code
    try:
        student = AutoConfig.from_pretrained(recipe.model.name_or_path, trust_remote_code=trust)
    except (OSError, ValueError):  # the student's own loading says what is wrong with it
        return None
    if problem := run_folder_problem(path, "distill.teacher"):
        return problem
    if missing_local(path):  # said before the hub is asked for it as an id
        return (f"distill.teacher '{path}' does not exist. Give a local model folder (config.json and weights; a "
                "run's final/ once it is trained) or a hub id.")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError) as e:
        return (f"distill.teacher '{path}' could not be read ({str(e).splitlines()[0]}). Give a local model folder "
                "(config.json and weights) or a hub id that is in the local Hugging Face cache.")
    if problem := scorer_problem(config, path, "distill.teacher"):
        return problem + ". Distill from a causal LM (the policy the reward model scores, or any model of the family)."
    # the student's rows as load_model leaves them (embedding_rows): a tokenizer longer than the model's rows (Mistral
    # v0.3's on a 32,000-row config) leaves them as they are
    theirs, ours = config.get_text_config().vocab_size, embedding_rows(recipe, tokenizer, student.get_text_config())
    fix = ("Distill from a teacher of the student's family (the same tokenizer), or train the student on the "
           "teacher's tokenizer first.")
    if recipe.model.new_tokens:
        fix += (f" model.new_tokens gives the student {', '.join(recipe.model.new_tokens)}: the teacher needs them "
                "too, as the final/ of a run with the same model.new_tokens has them.")
    if theirs != ours:
        return (f"distill.teacher '{path}' has a vocabulary of {theirs:,} ids and the student "
                f"(model.name_or_path '{recipe.model.name_or_path}') one of {ours:,}: the divergence compares the two "
                f"models' probabilities id by id, so they must share the vocabulary. {fix}")
    try:
        their_tokens = AutoTokenizer.from_pretrained(path, trust_remote_code=trust).get_vocab()
    except (OSError, ValueError, TypeError):  # a folder with weights and no tokenizer: the size is all we can check
        return None
    ours_tokens = tokenizer.get_vocab()
    differ = sorted(i for t, i in their_tokens.items() if ours_tokens.get(t) != i)
    if differ:
        token = next(t for t, i in their_tokens.items() if i == differ[0])
        return (f"distill.teacher '{path}' has {theirs:,} ids like the student, but its tokenizer gives {len(differ):,} "
                f"of them other tokens (id {differ[0]} is {token!r} for the teacher, "
                f"{tokenizer.convert_ids_to_tokens(differ[0])!r} for the student): the divergence compares the two "
                f"models' probabilities id by id, so they must share the vocabulary token for token. {fix}")
    return None


def teacher_problem(recipe: Recipe, tokenizer) -> str | None:
    """Why the teacher cannot be trained with (vocabulary_problem), a local teacher folder with a config.json and no
    weights (modeling.weights_problem, which its load refuses), or under sequence parallelism heads that do not split
    over the group: from its files, no weights read, as finetune, doctor and `llmtrain launch` check it."""
    if problem := vocabulary_problem(recipe, tokenizer) or weights_problem(recipe.distill.teacher,
                                                                           key="distill.teacher"):
        return problem
    if (n := recipe.parallel.sequence_parallel) > 1:  # it attends through the group's all-to-all too: its heads
        # split as the student's (said by every process after both models had loaded; audit 34)
        from llmtrain.capabilities import sequence_config_problem
        from llmtrain.model.modeling import load_model_config

        try:
            config = load_model_config(teacher_config(recipe), key="distill.teacher")
        except LLMTrainError as e:
            return str(e)
        if problem := sequence_config_problem(n, config, whose="its"):
            return f"the teacher {recipe.distill.teacher}: {problem}"
    return None


def load_teacher(recipe: Recipe, tokenizer, *, device: torch.device | None, empty: bool = False):
    """The teacher, checked (vocabulary_problem), frozen and in eval mode (no dropout): on `device`, or on the CPU
    where `device` is None (to be sharded: fsdp.shard_frozen). empty=True builds it without reading the weights (an
    FSDP process that receives its shards from the main process)."""
    if problem := vocabulary_problem(recipe, tokenizer):
        raise LLMTrainError(problem)
    teacher = load_model(teacher_config(recipe), None, device=device, empty=empty, key="distill.teacher")
    if device is not None:
        teacher = teacher.to(device)
    teacher.requires_grad_(False)
    return teacher.eval()
