"""Unpaired feedback as data (data.format: unpaired, for the kto: section): TRL's KTO rows, a prompt, a completion
and a boolean label (true: desirable, false: undesirable), as plain strings or conversational (the prompt a list of
messages, the completion a list of assistant messages). Columns are mapped through data.fields as for
prompt_completion rows.

Each row is encoded exactly as supervised fine-tuning encodes the row {prompt, completion} (formats.encode_example):
only the completion's tokens, up to and including the end of turn, are trained (their summed log-probability is what
KTO compares with the reference's). The label is kept beside the tokens. The KL estimate's mismatched sequences (a
prompt with another row's completion) are made per micro-batch by the objective (objectives/kto.py).
"""

from __future__ import annotations

from llmtrain.config import DataConfig
from llmtrain.data.formats import encode_example, row_problem

UNPAIRED_COLUMNS = ["input_ids", "labels", "label", "length", "cut_ids", "cut_labels"]  # cut_: encode_unpaired


def _as_sft(cfg: DataConfig) -> DataConfig:
    return cfg.model_copy(update={"format": "prompt_completion",
                                  "fields": {k: v for k, v in cfg.fields.items() if k != "label"}})


def unpaired_problem(example: dict, cfg: DataConfig) -> str | None:
    """What is wrong with one raw unpaired row, in words; None when it can be encoded."""
    name = cfg.fields.get("label", "label")
    label = example.get(name)
    if not isinstance(label, bool):
        got = "missing" if label is None else f"{label!r} ({type(label).__name__})"
        return (f"'{name}' (label) is {got}, not a boolean: KTO reads true as a desirable completion and false as "
                "an undesirable one")
    return row_problem(example, _as_sft(cfg))


def encode_unpaired(example: dict, tokenizer, cfg: DataConfig, *, template: str | None = None) -> dict:
    """The row as SFT encodes {prompt, completion}, with its label (1 desirable, 0 undesirable), and what
    data.max_seq_len cut off its end (`cut_ids`, `cut_labels`: its completion's, as a kept row's prompt fits): the KL
    sequences pair its whole completion with another row's prompt, as TRL's rotate the uncut completions (a shorter
    prompt leaves room for more of it; objectives/kto.kl_sequences)."""
    label = bool(example.get(cfg.fields.get("label", "label")))
    out = encode_example(example, tokenizer, _as_sft(cfg), template=template, keep_cut=True, rejected=not label)
    return {**out, "label": label}


def balance_warning(labels: list[bool], *, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's KTOTrainer warning when desirable and undesirable counts differ and neither weight is in the range
    eq. (8) of the KTO paper advises (desirable_weight x n_desirable / (undesirable_weight x n_undesirable) in
    [1, 4/3]); None when they are balanced or a weight is in range. The bounds rounded to 2 places, as TRL."""
    desirable = sum(bool(x) for x in labels)
    n_desirable = max(desirable, 1)
    n_undesirable = max(len(labels) - n_desirable, 1)
    if n_desirable == n_undesirable:
        return None
    des = (round(n_undesirable * undesirable_weight / n_desirable, 2),
           round(n_undesirable * undesirable_weight / n_desirable * 1.33, 2))
    und = (round(n_desirable * desirable_weight / n_undesirable / 1.33, 2),
           round(n_desirable * desirable_weight / n_undesirable, 2))
    if des[0] <= desirable_weight <= des[1] or und[0] <= undesirable_weight <= und[1]:
        return None
    return (f"{desirable:,} desirable and {len(labels) - desirable:,} undesirable completions, and the weights on "
            "their losses "
            f"(kto.desirable_weight={desirable_weight}, kto.undesirable_weight={undesirable_weight}) are outside the "
            "range the KTO paper advises (desirable_weight x desirable / (undesirable_weight x undesirable) in [1, "
            f"4/3]). Set EITHER kto.desirable_weight in [{des[0]}, {des[1]}] or kto.undesirable_weight in "
            f"[{und[0]}, {und[1]}] (but not both), as TRL's KTOTrainer advises")


def one_kind_problem(labels: list[bool], source: str, cfg: DataConfig) -> str | None:
    """Train rows of one label only: KTO weighs desirable completions against undesirable ones (kto.desirable_weight
    against kto.undesirable_weight); with one kind there is nothing to weigh, and a label column that reads the same
    on every row is far more often a mapping or export mistake than a choice. None when both kinds are there."""
    if not labels or len(set(labels)) > 1:
        return None
    name, value = cfg.fields.get("label", "label"), bool(labels[0])
    other = "undesirable (false)" if value else "desirable (true)"
    return (f"every one of the {len(labels):,} training rows of {source} has '{name}' {str(value).lower()}: "
            f"KTO learns from desirable completions set against undesirable ones, and these have no {other} row "
            f"to set against. Check that data.fields maps 'label' to the column that marks each completion, or add "
            f"{other} rows" + (". To train on desirable completions alone, use supervised fine-tuning (data.format: "
                               "prompt_completion, without the kto: section)" if value else ""))
