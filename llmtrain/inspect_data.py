"""`llmtrain inspect-data`: see exactly what training will see, before paying for a GPU."""

from __future__ import annotations

import json
import sys

from llmtrain.config import Recipe
from llmtrain.data.chat import data_tokenizer
from llmtrain.data.formats import IGNORE, prompt_length
from llmtrain.data.prepare import DataStats, prepare_recipe
from llmtrain.model.modeling import load_tokenizer


def _stats_table(stats: dict[str, DataStats], *, pairs: bool = False, prompts: bool = False, scored: bool = False):
    """The statistics of each split. A pair's length is its two sequences' (what a token budget bins), so it may
    be up to twice data.max_seq_len: the table says so. `scored`: a reward model's pairs, which train no token's
    label (each sequence is scored at its last token): no trained-token fraction."""
    from rich.table import Table

    table = Table(title="data statistics")
    table.add_column("")
    for split in stats:
        table.add_column(split, justify="right")
    rows = [
        ("pairs" if pairs else "prompts" if prompts else "examples", lambda s: f"{s.examples:,}"),
        ("truncated", lambda s: f"{s.truncated:,}"),
        ("dropped", lambda s: f"{s.dropped:,}" + (f" ({', '.join(s.drops)})" if s.drops else "")),
        ("tokens", lambda s: f"{s.tokens:,}"),
        *([] if prompts else [("scored tokens", lambda s: "1 a sequence (its last)")] if scored else
          [("trained-token fraction", lambda s: f"{s.trained_fraction:.1%}")]),
        ("pair length (chosen + rejected) p50 / p90 / p99 / max" if pairs else "length p50 / p90 / p99 / max",
         lambda s: f"{s.length_p50} / {s.length_p90} / {s.length_p99} / {s.length_max}"),
    ]
    for name, fmt in rows:
        table.add_row(name, *(fmt(s) for s in stats.values()))
    return table


def token_pieces(input_ids: list[int], tokenizer) -> list[str]:
    """Each token's text as it reads in the decoded sequence, so that the pieces join to the decoded text.

    Decoding one token alone loses its leading space with SentencePiece tokenizers ("▁sold" decodes to
    "sold"), so each piece is the difference between decoding a few tokens before it with and without it.
    A piece that ends inside a multi-byte character (the decoder shows "\ufffd") waits for the next token.
    """
    pieces, start = [], 0  # start: the first token whose text is not out yet
    for k in range(len(input_ids)):
        window = max(0, start - 4)
        before, after = tokenizer.decode(input_ids[window:start]), tokenizer.decode(input_ids[window:k + 1])
        if after.endswith("\ufffd") and k + 1 < len(input_ids):
            pieces.append("")
            continue
        pieces.append(after[len(before):] if after.startswith(before) else tokenizer.decode(input_ids[start:k + 1]))
        start = k + 1
    return pieces


def _highlight(input_ids: list[int], labels: list[int], tokenizer, *, marks: bool = False, offset: int = 0):
    """The example token by token: trained tokens in bold green, masked ones dim. With `marks` (output without
    colour: a pipe, a log file, NO_COLOR) each run of trained tokens also stands between « and ». `offset`: where
    these tokens start in their sequence (a pair's answer, shown after its prompt)."""
    from rich.text import Text

    text, inside = Text(), False
    for k, (piece, lab) in enumerate(zip(token_pieces(input_ids, tokenizer), labels), start=offset):
        # nothing predicts a sequence's first token (train_on_prompt's BOS): not counted (an answer's first token,
        # shown from its own start, had been taken for it: `Paris«</s>»`)
        trained = lab != IGNORE and k > 0
        if marks and trained != inside:
            text.append("«" if trained else "»")
            inside = trained
        text.append(piece, style="bold green" if trained else "dim")
    if inside:
        text.append("»")
    return text


def inspect_data(recipe: Recipe, *, n: int, as_json: bool) -> None:
    import datasets
    from rich.console import Console
    from rich.panel import Panel

    datasets.disable_progress_bars()
    tokenizer = data_tokenizer(load_tokenizer(recipe.model), recipe.data)  # finetune's: the same cache entry
    train, evald, stats, _ = prepare_recipe(recipe, tokenizer)
    rows = train.select(range(min(n, len(train))))
    if recipe.data.sources is not None:  # a mixture: its first examples in the order training reads them
        from llmtrain.data.checks import data_plan
        from llmtrain.data.mixture import describe, short_name, source_sizes

        sizes = source_sizes(train["source"])
        # the run's data plan (one process): under a token budget its bins, packed over the epoch's examples, are
        # not the mixture's order (none of the first 30 shown had been among the 25 three steps trained; audit 41)
        plan = data_plan(recipe, train["length"], world=1, sources=train["source"])
        order = [i for batch in plan.global_batches_in(n, 1) for rank in batch for i in rank]
        rows = train.select(order[:n])
        for line in ([] if as_json else describe(recipe.data, stats, sizes)):
            Console(stderr=True).print(f"data source: {line}", highlight=False, soft_wrap=True)  # paths unbroken
        # the totals first, then each source by its file's name
        names = {f"source{i}": short_name(source) for i, source in enumerate(recipe.data.sources)}
        stats = {names.get(k.removesuffix("_eval"), k) + (" eval" if k.endswith("_eval") else ""): v
                 for k, v in sorted(stats.items(), key=lambda kv: not kv[0] in ("train", "eval"))}
    if "chosen_ids" in train.column_names:
        return _show_pairs(rows, stats, tokenizer, as_json=as_json, scored=recipe.reward_model is not None)
    if as_json:
        # Exactly the rows training reads (before packing and the per-example shift), one per line: KTO's label, a
        # mixture's source and an RL prompt's columns for the rewards beside them (the panels show those; audit 39)
        from llmtrain.objectives.rewards import reward_columns

        given = {"label": "label", "source": "source"}
        given |= reward_columns(rows.column_names) if recipe.data.format == "prompt" else {}
        for k, (ids, labels) in enumerate(zip(rows["input_ids"], rows["labels"])):
            extra = {name: rows[stored][k] for name, stored in given.items() if stored in rows.column_names}
            # training's fields over a user's column of the same name; a value JSON has no type for as its text
            sys.stdout.write(json.dumps({**extra, "input_ids": ids, "labels": labels}, default=str) + "\n")
        return
    console = Console()
    marks = console.no_color or console.color_system is None
    if recipe.data.format == "prompt":  # online RL: the prompt as generation continues it, and the rewards' columns
        from llmtrain.objectives.rewards import reward_columns

        extra = reward_columns(train.column_names)
        for i, row in enumerate(rows):
            columns = "; ".join(f"{name}={row[stored]!r}" for name, stored in extra.items())
            console.print(Panel(_highlight(row["input_ids"], row["labels"], tokenizer, marks=False),
                                title=f"prompt, row {row['row'] + 1}: {len(row['input_ids'])} tokens (completions "
                                      "are sampled)",
                                subtitle=f"to the rewards: {columns}" if columns else None, title_align="left"))
        console.print(_stats_table(stats, prompts=True))
        return
    feedback = rows["label"] if "label" in rows.column_names else [None] * len(rows)  # KTO: desirable or not
    for i, (ids, labels, label) in enumerate(zip(rows["input_ids"], rows["labels"], feedback)):
        trained = sum(lab != IGNORE for lab in labels[1:])
        how = "«between marks»" if marks else "green"
        said = "" if label is None else ", desirable" if label else ", undesirable"
        prompt = prompt_length(labels)
        # distillation: what the student completes at on-policy steps, and what the others train on
        student = (f"distill: the student samples a completion of the first {prompt} tokens at on-policy steps; "
                   "the trained tokens are the data's (off-policy steps, eval)") if recipe.distill else None
        console.print(Panel(_highlight(ids, labels, tokenizer, marks=marks),
                            title=f"example {i + 1}{said}: {len(ids)} tokens, {trained} trained ({how})",
                            subtitle=student, title_align="left"))
    console.print(_stats_table(stats))
    if recipe.kto is not None:
        console.print(feedback_balance(recipe, {"train": train, **({"eval": evald} if evald is not None else {})}))


def feedback_balance(recipe: Recipe, splits: dict) -> str:
    """KTO's unpaired rows: each split's desirable and undesirable counts, and TRL's warning where the train split's
    balance and the recipe's kto weights are outside the range the KTO paper advises (as `llmtrain doctor` says)."""
    from llmtrain.data.unpaired import balance_warning

    lines = []
    for name, ds in splits.items():
        desirable = sum(ds["label"])
        lines.append(f"{name}: {desirable:,} desirable and {len(ds) - desirable:,} undesirable completions "
                     f"({desirable / max(len(ds), 1):.1%} desirable)")
    k = recipe.kto
    warn = balance_warning(splits["train"]["label"], desirable_weight=k.desirable_weight,
                           undesirable_weight=k.undesirable_weight)
    lines.append(f"warning (desirable balance): {warn}" if warn else
                 f"desirable balance: kto.desirable_weight={k.desirable_weight:g} and kto.undesirable_weight="
                 f"{k.undesirable_weight:g} suit these counts, as TRL's KTOTrainer advises")
    return "\n".join(lines)


def _show_pairs(rows, stats, tokenizer, *, as_json: bool, scored: bool = False) -> None:
    """Preference pairs: the prompt once, then each answer with its trained tokens marked; `scored` (a reward
    model's pairs: it reads prompt and answer together and scores the sequence at its last token, training no
    token's label) with the token it is scored at marked instead."""
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.text import Text

    from llmtrain.model.modeling import pad_id
    from llmtrain.model.score import scored_position

    columns = ["chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"]
    pad = pad_id(tokenizer)
    if as_json:  # a reward model's pair trains no token's label: the position each answer is scored at instead
        for k, values in enumerate(zip(*(rows[c] for c in columns))):
            row = dict(zip(columns, values))
            if scored:
                row = {"chosen_ids": row["chosen_ids"], "chosen_scored_at": scored_position(row["chosen_ids"], pad),
                       "rejected_ids": row["rejected_ids"],
                       "rejected_scored_at": scored_position(row["rejected_ids"], pad)}
            row |= {c: rows[c][k] for c in ("margin", "source") if c in rows.column_names}
            sys.stdout.write(json.dumps(row) + "\n")
        return

    console = Console()
    marks = console.no_color or console.color_system is None
    for i, (c_ids, c_labels, r_ids, r_labels) in enumerate(zip(*(rows[c] for c in columns))):
        start = prompt_length(c_labels)
        prompt = Text(tokenizer.decode(c_ids[:start]), style="dim")
        parts = [Text("prompt: ", style="bold"), prompt]
        for name, ids, labels in (("chosen", c_ids, c_labels), ("rejected", r_ids, r_labels)):
            k = prompt_length(labels)
            if scored:  # the token training reads (score.scored_position: before a final EOS that is the pad)
                at = scored_position(ids, pad)
                labels = [IGNORE] * len(ids)
                labels[at] = ids[at]
                said = "scored at its last token" if at == len(ids) - 1 else \
                    "scored at its last token before the final EOS, which is the pad token"
            else:
                said = f"{sum(lab != IGNORE for lab in labels[1:])} trained tokens"
            parts += [Text(f"\n{name} ({said}): ", style="bold"),
                      _highlight(ids[k:], labels[k:], tokenizer, marks=marks, offset=k)]
        console.print(Panel(Group(Text.assemble(*parts)), title=f"pair {i + 1}: {len(c_ids)} + {len(r_ids)} tokens",
                            title_align="left"))
    console.print(_stats_table(stats, pairs=True, scored=scored))
