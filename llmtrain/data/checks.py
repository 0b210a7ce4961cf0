"""The data checks that `finetune` (which stops on a fail) and `llmtrain doctor` share.

Each check is a small function that returns rows of (name, status, detail), status one of pass / warn / fail,
so tests call them directly: the tokenizer and chat template, the loss masks, the stop token trained, the token
budget, and the schedule's warm-up against the run's length.
"""

from __future__ import annotations

import math
from pathlib import Path

from llmtrain.capabilities import unit_of
from llmtrain.config import Recipe, updates_per_window
from llmtrain.data.formats import IGNORE, prompt_length, special_ids
from llmtrain.data.prepare import DataStats
from llmtrain.errors import LLMTrainError

Check = tuple[str, str, str]  # (name, "pass" | "info" | "skipped" | "warn" | "fail", detail: what was found, key, fix)

EOS_SAMPLE = 200  # rows whose last trained label is checked


# --------------------------------------------------------------------------- tokenizer and template


def check_tokenizer(tokenizer) -> list[Check]:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None:
        return [("tokenizer eos/pad", "fail", "the tokenizer has no eos_token: the model never learns to stop. "
                 "Set eos_token in the tokenizer_config.json of model.tokenizer.")]
    if pad is None:
        return [("tokenizer eos/pad", "warn", f"eos {tokenizer.eos_token!r} (id {eos}); no pad token, so padding "
                 "uses eos. Pad positions are masked from attention and loss, so this is safe unless a tool of "
                 "yours reads pad == eos as the end.")]
    return [("tokenizer eos/pad", "pass", f"eos {tokenizer.eos_token!r} (id {eos}), pad {tokenizer.pad_token!r} "
             f"(id {pad})")]


def check_new_tokens(recipe: Recipe, tokenizer) -> list[Check]:
    """model.new_tokens: each one's id in the grown tokenizer, and what trains their rows."""
    new = recipe.model.new_tokens
    if not new:
        return []
    ids = ", ".join(f"{t} {tokenizer.convert_tokens_to_ids(t)}" for t in new)
    rows = ("as lora.modules_to_save " + ", ".join(recipe.lora.modules_to_save) + " (trained in full, saved with the "
            "adapter)") if recipe.lora is not None else "with the rest of the model"
    return [("new tokens", "pass", f"{len(new)} special token{'s' * (len(new) > 1)} (one id each, never split; ids: "
             f"{ids}); the embedding rows of those past the model's own start at the mean row and train {rows}")]


def needs_chat(recipe: Recipe) -> bool:
    """Whether any of the recipe's datasets is rendered through the chat template (a mixture's every source: its
    data.format is its first source's, and a chat source after a plain one had gone unchecked; audit 41)."""
    from llmtrain.config import source_configs
    from llmtrain.data.formats import conversational_rows

    return any(d.format == "messages" or (d.format in ("prompt_completion", "unpaired", "prompt", "preference")
                                          and d.chat_template is not False) or conversational_rows(d)
               for d in source_configs(recipe.data))


def check_chat_template(recipe: Recipe, tokenizer) -> list[Check]:
    """Render a two-turn chat as training will, when the data is formatted with a chat template."""
    from llmtrain.data.chat import read_template
    from llmtrain.data.formats import encode_messages

    if not needs_chat(recipe):
        return [("chat template", "pass", f"not used (data.format={recipe.data.format}, data.chat_template false)")]
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    if recipe.data.system_prompt is not None:  # as training puts it first (a template that requires a system turn
        # had failed here while finetune trained)
        chat = [{"role": "system", "content": recipe.data.system_prompt}, *chat]
    try:
        ids, labels = encode_messages(chat, tokenizer, train_on_prompt=False,
                                      template=read_template(recipe.data, tokenizer))
    except LLMTrainError as e:
        return [("chat template", "fail", f"{e} (data.chat_template)")]
    trained = tokenizer.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])
    return [("chat template", "pass", f"renders; of the chat [user: 'What is 2 + 2?', assistant: '4'], the tokens "
             f"trained (the reply and its end of turn; the prompt is masked) read {trained!r}")]


# --------------------------------------------------------------------------- data and masks


def check_masks(stats: DataStats, *, train_on_prompt: bool, text: bool, max_seq_len: int,
                unit: str = "examples", scored: bool = False) -> list[Check]:
    """Masks neither all-zero nor all-one; truncated and dropped counts (unit: examples, or pairs). `scored`: a
    reward model's pairs, which train no token's label (each answer is scored at its last token)."""
    seen = stats.examples + stats.dropped
    counts = (f"{stats.examples:,} {unit}, {trained_text(stats, scored)}, "
              f"{stats.truncated:,} truncated, {stats.dropped:,} dropped")
    if stats.examples == 0:
        return [("loss mask", "fail", f"no trained token in any of {seen:,} {unit} ({counts}): the loss is 0 "
                 "and nothing is learned. Check data.format / data.fields, or raise data.max_seq_len if the "
                 "prompts fill it.")]
    rows = [("data", "pass", counts)]
    if scored:  # the mask only finds each answer's end: what it would say of trained tokens does not apply
        rows.append(("loss mask", "pass", f"{SCORED}: no token's label is trained"))
        return rows + _cut_rows(stats, unit, max_seq_len)
    # The first token of each example is never a target, so "all trained" is tokens - examples.
    if not train_on_prompt and not text and stats.trained_tokens >= stats.tokens - stats.examples:
        rows.append(("loss mask", "warn", "every token is trained although data.train_on_prompt is false: the "
                     "prompt is not masked. Check data.format / data.fields (is the prompt in the completion?)."))
    else:
        rows.append(("loss mask", "pass", f"{stats.trained_fraction:.1%} of tokens trained"))
    return rows + _cut_rows(stats, unit, max_seq_len)


SCORED = "each answer scored at its last token"  # a reward model's pairs (reward_model:)


def trained_text(stats: DataStats, scored: bool = False) -> str:
    """'29.6% of tokens trained', or for a reward model's pairs what its loss reads instead (start-up, doctor)."""
    return SCORED if scored else f"{stats.trained_fraction:.1%} of tokens trained"


def _cut_rows(stats: DataStats, unit: str, max_seq_len: int) -> list[Check]:
    """The dropped and truncated warnings of check_masks."""
    rows: list[Check] = []
    if stats.dropped:  # a longer max_seq_len keeps only the rows it cut to nothing (the reasons say which: a pair
        # whose chosen is its rejected, say, stays dropped)
        cut = not stats.drops or any("max_seq_len" in reason for reason in stats.drops)
        fix = (f"Raise data.max_seq_len (now {max_seq_len}) to keep those cut to nothing, or remove the rows" if cut
               else "Fix or remove the rows")
        rows.append(("dropped", "warn", f"{stats.dropped_text(unit)}; the rest trains. {fix}."))
    if stats.truncated:
        cut = " at the prompt's start or the answers' end" if unit == "pairs" else ""
        rows.append(("truncated", "warn", f"{stats.truncated:,} of {stats.examples:,} {unit} are cut{cut} to fit "
                     f"data.max_seq_len={max_seq_len}; raise it if what is cut matters."))
    return rows


def check_eos_trained(labels: list[list[int]], tokenizer, unit: str = "examples",
                      end_of_turn: str | None = None) -> list[Check]:
    """The trained tokens of each row end with a stop the samplers stop at (generate.Stops: EOS, an end-of-turn
    special token, or the template's end of turn `end_of_turn` as one of the token runs chat.turn_tokens reads it as:
    `<|im_end|>` is text on a tokenizer that does not know it), whitespace after it aside: the model learns to stop
    where generation will (unit: examples, or answers: each pair's two)."""
    from llmtrain.data.chat import text_turn, turn_tokens

    stops = {tokenizer.eos_token_id, *special_ids(tokenizer)}
    sequences = turn_tokens(tokenizer, end_of_turn)
    split = bool(text_turn(tokenizer, end_of_turn)) and not sequences

    def stops_there(trained: list[int]) -> bool:
        while trained and trained[-1] not in stops and not tokenizer.decode(trained[-1:]).strip():
            trained = trained[:-1]  # a newline trained after the end of turn
        return bool(trained) and (trained[-1] in stops or any(tuple(trained[-len(s):]) == s for s in sequences))

    last = [[lab for lab in row if lab != IGNORE] for row in labels]
    missing = sum(1 for t in last if not stops_there(t))
    only_stop = sum(1 for t in last if len(t) == 1 and t[0] in stops)
    name, n = "eos trained", len(labels)
    if n and missing == n:
        why = (f"the template ends a reply with {end_of_turn.strip()!r}, which this tokenizer splits into pieces that "
               "change with the text before it, so generation cannot tell where a reply ends. Make it one token "
               "(a template the tokenizer was trained with, whose end of turn is a special token of it), or end "
               "each reply with the tokenizer's eos_token in the template" if split else
               f"none of {n} {unit} ends with a trained {tokenizer.eos_token!r} or end-of-turn token: generation "
               "will not stop. Check the chat template (data.chat_template)")
        return [(name, "fail", f"{why}.")]
    text_end = (f" (the template's {end_of_turn.strip()!r} is text of several tokens here: generation stops at them; "
                "a server of the exported model needs it as a stop string, docs/data.md)" if sequences else "")
    rows = [(name, "warn" if missing else "pass",
             f"{n - missing} of {n} {unit} end with a trained stop token{text_end}"
             + (f"; {missing} do not (cut at data.max_seq_len?)" if missing else ""))]
    if only_stop:
        rows.append(("empty replies", "warn", f"{only_stop} of {n} {unit} train only the stop token: their "
                     "completion is empty. Check data.fields."))
    return rows


def check_budget(budget: int | None, lengths: list[int], *, max_seq_len: int | None = None,
                 pairs: bool = False) -> list[Check]:
    """With a token budget (train.micro_batch_tokens) every example must fit one micro-batch: none is ever split or
    dropped. `pairs`: an example is a preference pair, two sequences of up to data.max_seq_len each."""
    if budget is None:
        return []
    longest = max(lengths, default=0)
    if longest > budget:
        cut = budget // 2 if pairs else budget  # (for a pair it had advised the budget: both its sequences)
        truncate = (f", or truncate the examples with data.max_seq_len={cut}"
                    + (" (a pair is both its sequences)" if pairs else "")) if cut < (max_seq_len or cut + 1) else ""
        return [("token budget", "fail", f"train.micro_batch_tokens={budget} is smaller than the longest example "
                 f"({longest} tokens{', a pair' if pairs else ''}); no example is ever split or dropped. Raise "
                 f"train.micro_batch_tokens to at least {longest}{truncate}.")]
    return [("token budget", "pass", f"the longest example ({longest} tokens) fits train.micro_batch_tokens={budget}")]


def check_kl_pairs(recipe: Recipe, train_lengths: list[int], eval_lengths: list[int]) -> list[Check]:
    """KTO's KL estimate under a token budget: it is made of mismatched pairs within a micro-batch (each prompt with
    another example's completion), so a micro-batch needs two examples or more. The budget's bins (best-fit
    decreasing, batching.token_bins) open a new bin only for an example no open bin can take: where the two longest
    examples of a split fit the budget together, a bin holding one example can take any other, so every bin but the
    last opened holds two or more (at most one micro-batch an epoch holds one example, as the last of an epoch by
    examples may). Where they do not fit, any number of micro-batches may hold a long example alone, whose KL term
    would be its own implied reward."""
    budget = recipe.train.micro_batch_tokens
    if recipe.kto is None or recipe.kto.loss_type != "kto" or budget is None:
        return []
    for split, lengths in (("training", train_lengths), ("eval", eval_lengths)):
        if len(lengths) < 2:
            continue
        a, b = sorted(lengths)[-2:]
        if a + b > budget:
            return [("KL pairs", "fail", f"kto.loss_type: kto estimates the KL term from mismatched pairs within a "
                     f"micro-batch, and the two longest {split} examples ({b} and {a} tokens) do not fit "
                     f"train.micro_batch_tokens={budget} together: a micro-batch could hold one example alone, whose "
                     f"KL term would be its own implied reward. Raise train.micro_batch_tokens to at least {a + b}, "
                     f"or cut the examples shorter (data.max_seq_len={budget // 2} makes any two fit)")]
    return [("KL pairs", "pass", f"any two examples fit train.micro_batch_tokens={budget}: every micro-batch but "
             "at most one an epoch holds two or more (KTO's KL estimate)")]


def largest_id(*datasets) -> int:
    """The largest token id in the datasets' id columns (input_ids, chosen_ids, ...: lists of ints), read with
    pyarrow's kernels (no row is decoded); -1 where there is none."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found = -1
    for ds in filter(None, datasets):
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        for name in ds.column_names:
            column = table.column(name)
            if name.endswith("ids") and pa.types.is_list(column.type) and pa.types.is_integer(column.type.value_type):
                top = pc.max(pc.list_flatten(column)).as_py()
                found = max(found, -1 if top is None else top)
    return found


def check_token_ids(recipe: Recipe, tokenizer, rows: int | None, train, eval_ds) -> list[Check]:
    """Every token id of the data has a row in the model's embedding (`rows`: model.modeling.embedding_rows): a
    tokenizer that is not the model's (model.tokenizer) gives ids past it, and the first step would stop in the
    embedding's lookup."""
    if rows is None:
        return []
    top = largest_id(train, eval_ds)
    if top < rows:
        return []
    token = tokenizer.convert_ids_to_tokens(top)
    given = (f"model.tokenizer '{recipe.model.tokenizer}'" if recipe.model.tokenizer else
             f"the tokenizer of '{recipe.model.name_or_path}'")
    return [("token ids", "fail", f"{given} gives the data token ids up to {top:,} ({token!r}), and the model "
             f"'{recipe.model.name_or_path}' has {rows:,} embedding rows (its config's vocab_size): the tokenizer is "
             "not the model's. Give the model's own tokenizer (unset model.tokenizer, or the folder it was trained "
             "with); to add tokens to a model, list them in model.new_tokens.")]


def check_data(recipe: Recipe, stats: DataStats, train, eval_ds, tokenizer, *, rows: int | None = None) -> list[Check]:
    """The data checks `finetune` (which stops on a fail) and `doctor` share: the token ids within the model's
    embedding (`rows`: model.modeling.embedding_rows, None: unknown), the loss mask, the stop token trained, and the
    token budget, on the tokenised train (and eval) sets."""
    unused = check_token_ids(recipe, tokenizer, rows, train, eval_ds) + check_no_eval(recipe, eval_ds) + \
        check_hub_keys(recipe) + check_eval_overlap(recipe) + check_unread_rates(recipe)
    if recipe.data.format == "prompt":  # online RL: nothing is trained from the data; the completions need room
        return (unused + check_prompt_room(recipe, train, eval_ds) + check_completion_stop(recipe, tokenizer)
                + check_ratio_keys(recipe))
    pairs = recipe.data.format == "preference"
    unused += check_unsampled_keys(recipe)
    rows = unused + check_masks(stats, train_on_prompt=recipe.data.train_on_prompt,
                                text=recipe.data.format == "text", max_seq_len=recipe.data.max_seq_len,
                                unit="pairs" if pairs else "examples", scored=recipe.reward_model is not None)
    if len(train):
        sample = train.select(range(min(EOS_SAMPLE, len(train))))
        labels = (list(sample["chosen_labels"]) + list(sample["rejected_labels"]) if pairs  # both answers must stop
                  else list(sample["labels"]))
        rows += check_eos_trained(labels, tokenizer, unit="answers" if pairs else "examples",
                                  end_of_turn=_end_of_turn(recipe, tokenizer))
        if not pairs and recipe.data.format != "text":  # empty replies over every row, not the first EOS_SAMPLE
            # (five after row 200 had gone unsaid): the preparation counted the rows that train one token alone
            rows = [r for r in rows if r[0] != "empty replies"] + (
                [("empty replies", "warn", f"{stats.one_token:,} of {stats.examples:,} examples train only the stop "
                  "token: their completion is empty. Check data.fields.")] if stats.one_token else [])
    if stats.untooled:
        rows.append(("tool schemas", "warn", f"{stats.untooled:,} of {stats.examples:,} examples call tools and "
                     "give no `tools`: the chat template shows the model no schema, so it learns to call tools it "
                     "is never shown. Give each row its tools (a `tools` column of JSON schemas, TRL's format: "
                     "docs/tools.md); where a system message of the rows describes them, as some datasets' do, this "
                     "is as meant."))
    if recipe.kto is not None and len(train):  # TRL's warning on the balance of desirable and undesirable rows
        from llmtrain.data.unpaired import balance_warning

        warn = balance_warning(train["label"], desirable_weight=recipe.kto.desirable_weight,
                               undesirable_weight=recipe.kto.undesirable_weight)
        rows.append(("desirable balance", "warn", warn) if warn else
                    ("desirable balance", "pass", f"{sum(train['label']):,} desirable, "
                     f"{len(train) - sum(train['label']):,} undesirable completions"))
    if recipe.reward_model is not None:
        rows.append(check_margin(train, eval_ds))
    if recipe.distill is not None and recipe.distill.lmbda > 0:  # on-policy steps sample after each row's prompt
        rows += check_prompt_room(recipe, train, None)
    lengths = [*train["length"], *(eval_ds["length"] if eval_ds is not None else [])]
    rows += check_eval_batch(recipe, train["length"], eval_ds["length"] if eval_ds is not None else [])
    return rows + check_budget(recipe.train.micro_batch_tokens, lengths, max_seq_len=recipe.data.max_seq_len,
                               pairs=unit_of(recipe) == "pairs") + check_kl_pairs(
        recipe, train["length"], eval_ds["length"] if eval_ds is not None else [])


def check_margin(train, eval_ds) -> Check:
    """A reward model's margins (TRL's optional margin column): in both splits or in neither."""
    has_train, has_eval = "margin" in train.column_names, eval_ds is not None and "margin" in eval_ds.column_names
    if eval_ds is not None and has_train != has_eval:
        has, lacks = ("train", "eval") if has_train else ("eval", "train")
        return ("margin", "fail", f"the {has} pairs have a margin column and the {lacks} pairs do not: a reward "
                "model's loss subtracts each pair's margin, so both need it (or neither). Add the column to the "
                f"{lacks} data, or drop it from the {has} data")
    if has_train:
        return ("margin", "pass", f"each pair's margin is subtracted from its score difference (mean "
                f"{sum(train['margin']) / max(len(train), 1):.3g})")
    return ("margin", "pass", "no margin column: the loss is -log sigmoid(r_chosen - r_rejected)")


EVAL_BATCH_RATIO = 4  # an eval micro-batch more than this many times the training's tokens is warned about


def check_unread_rates(recipe: Recipe) -> list[Check]:
    """Rate keys the run reads nothing of (audit 47: accepted without a word): said, not refused, since a run's own
    recipe.yaml spells out every key and a run of before must stay readable (generate, eval, --resume)."""
    t, lora = recipe.train, recipe.lora
    said = []
    if t.schedule == "constant" and t.min_lr_ratio != 0:
        said.append(f"train.min_lr_ratio={t.min_lr_ratio:g} is where the linear and cosine schedules end, and "
                    "train.schedule is constant (set train.min_lr_ratio=0, or train.schedule=cosine)")
    if lora is not None and lora.lr_ratio is None and lora.off_default("lr_embedding"):
        said.append(f"lora.lr_embedding={lora.lr_embedding:g} is LoRA+'s rate of the embeddings' adapter, and "
                    "lora.lr_ratio is not set (set lora.lr_ratio, e.g. 16, or leave lora.lr_embedding out)")
    return [("unread", "warn", "; ".join(said) + ": nothing in this run reads it")] if said else []


def check_no_eval(recipe: Recipe, eval_ds) -> list[Check]:
    """No eval data (data.eval_split null, the way to turn evaluation off), and keys that would shape an evaluation
    set: said once at the start (they are left as they are, so the recipe still evaluates where a split comes back)."""
    keys = [f"{k}={v}" for k, v in (("train.eval_every_steps", recipe.train.eval_every_steps),
                                     ("data.eval_max_examples", recipe.data.eval_max_examples)) if v is not None]
    keys += [f"train.{k}={getattr(recipe.train, k)}" for k in ("eval_batch_size", "eval_samples", "eval_max_new_tokens")
             if recipe.train.off_default(k)]  # the eval's batches and generations (samples.jsonl)
    if eval_ds is not None or not keys:
        return []
    listed = ", ".join(keys[:-1]) + " and " + keys[-1] if len(keys) > 1 else keys[0]
    return [("no eval", "warn", f"data.eval_split gives no eval data, so the run does not evaluate, and "
             f"{listed} {'have' if len(keys) > 1 else 'has'} nothing to act on. Give data.eval_split (a "
             "fraction, a split or a file) to evaluate")]


def check_eval_overlap(recipe: Recipe) -> list[Check]:
    """data.eval_split naming the training data itself (the same file, or the split data.split trains on): every eval
    row is a training row, so the eval measures memorisation. Said, not refused (a smoke test may mean it)."""
    from llmtrain.data.sources import files, is_local

    d = recipe.data
    if d.sources is not None or d.path is None or not isinstance(d.eval_split, (str, list)):
        return []
    paths = files(d.path)
    held = files(d.eval_split)
    trained = {Path(p).resolve() for p in paths if Path(p).is_file()}
    same = [q for q in held if Path(q).is_file() and Path(q).resolve() in trained]
    split = (not is_local(paths) or Path(paths[0]).is_dir()) and held == [d.split]
    if not same and not split:
        return []
    what = f"the file {same[0]}, which data.path trains on" if same else f"the split '{d.split}' data.split trains on"
    return [("eval overlap", "warn", f"data.eval_split names {what}: every eval row is a training row, so the eval "
             "loss measures what the model memorised, not what it generalises. Give held-out rows (another file or "
             "split, or a fraction: data.eval_split=0.05)")]


def check_ratio_keys(recipe: Recipe) -> list[Check]:
    """Online RL's keys that act on the ratio of the policy to the one that sampled (rl.epsilon_high, rl.delta,
    GSPO's importance_sampling_level), set where it is always 1 (rl.num_iterations 1): said, not refused (TRL takes
    them so too), as they change nothing. Not said with rl.sampler_correction: the rollout then keeps the policy's
    log-probabilities as it sampled (a forward without LoRA's dropout, as TRL keeps them with vLLM's correction) and
    the update divides by them, so the ratio moves with the dropout, and the off-policy mask reads the sampler's own."""
    rl = recipe.rl
    if rl is None or rl.num_iterations > 1 or rl.sampler_correction is not None:
        return []
    # cispo's epsilon_high is required (its cap): not said
    keys = [f"rl.{k}={v}" for k, v in (("epsilon_high", rl.epsilon_high if rl.loss_type != "cispo" else None),
                                         ("delta", rl.delta), ("off_policy_mask_threshold",
                                                               rl.off_policy_mask_threshold)) if v is not None]
    # (luspo's level is sequence by its definition, filled in by the schema: there is no key to remove)
    keys += (["rl.importance_sampling_level=sequence"] if rl.importance_sampling_level == "sequence"
             and rl.loss_type != "luspo" else [])
    if not keys:
        return []
    act, they, them = ("act", "they change", "them") if len(keys) > 1 else ("acts", "it changes", "it")
    return [("ratio", "warn", f"{' and '.join(keys)} {act} on the ratio of the policy to the one that sampled, which "
             f"is 1 with rl.num_iterations 1 (every step samples anew): {they} nothing. Set rl.num_iterations 2 or "
             f"more (several updates a generation round, docs/rl.md) for {them} to bind, or remove {them}")]


def check_unsampled_keys(recipe: Recipe) -> list[Check]:
    """distill.lmbda 0 samples nothing (every step trains on the data's completions): the student's sampling keys
    given are read by nothing. Said, not refused (TRL's GKDTrainer takes them so too, and a recipe switched to 0 for
    a run keeps working); they had been taken without a word, the start-up line announcing a merged copy."""
    d = recipe.distill
    if d is None or d.lmbda != 0:
        return []
    unread = [f"distill.{k}" for k in ("max_completion_tokens", "top_p", "top_k", "min_p", "repetition_penalty",
                                        "sampler", "merged_copy") if d.off_default(k)]
    if not unread:
        return []
    return [("sampling", "warn", f"distill.lmbda=0 trains every step on the data's completions, so the student samples "
             f"nothing: {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} read by nothing. Raise distill.lmbda "
             f"(the share of steps the student samples) for {'it' if len(unread) == 1 else 'them'} to act, or remove "
             f"{'it' if len(unread) == 1 else 'them'}")]


def check_hub_keys(recipe: Recipe) -> list[Check]:
    """data.name and data.split choose a hub dataset's (or a dataset folder's) configuration and split; local data
    files have neither, and every row of them is read: said once where a recipe made for a hub dataset is pointed at
    files (`data.path=train.jsonl` on a recipe with `name: main`)."""
    from llmtrain.data.sources import files, is_local

    d = recipe.data
    paths = files(d.path) if d.path is not None else []
    if not paths or not is_local(paths) or (len(paths) == 1 and Path(paths[0]).is_dir()):
        return []
    keys = [k for k, on in ((f"data.name={d.name}", d.name is not None), (f"data.split={d.split}", d.split != "train"))
            if on]
    if not keys:
        return []
    fixes = [fix for fix, on in (("unset data.name (data.name=null)", d.name is not None),
                                 ("set data.split=train, its default (or remove it from the recipe)",
                                  d.split != "train")) if on]
    fixes[0] = fixes[0][0].upper() + fixes[0][1:]
    return [("hub keys", "warn", f"data.path is local files, which have no configurations or splits: every row of "
             f"them is read, and {' and '.join(keys)} {'is' if len(keys) == 1 else 'are'} not used (a hub "
             f"dataset's configuration and split). {' and '.join(fixes)} (or point data.path at the hub dataset or "
             "a dataset folder)")]


def check_eval_batch(recipe: Recipe, train_lengths: list[int], eval_lengths: list[int]) -> list[Check]:
    """A fixed train.eval_batch_size of long examples can put many times the training's tokens into one forward
    (16 examples of 64K: 1M tokens, each layer's MLP intermediates for all of them at once), so that evaluation, not
    training, sets the peak memory. Unset, evaluation batches by the training's token budget."""
    t = recipe.train
    if t.eval_batch_size is None or not eval_lengths or not train_lengths:
        return []
    longest = max(eval_lengths)
    evals = t.eval_batch_size * longest
    trains = t.micro_batch_tokens or t.micro_batch_size * max(train_lengths)
    if evals <= EVAL_BATCH_RATIO * trains:
        return []
    fits = max(1, trains // longest)
    budget = " (train.micro_batch_tokens)" if t.micro_batch_tokens else ""
    return [("eval batch", "warn", f"train.eval_batch_size={t.eval_batch_size} puts up to {t.eval_batch_size} x "
             f"{longest:,} = {evals:,} tokens into one eval forward, {evals / trains:.0f}x the training micro-batch's "
             f"{trains:,}: evaluation, not training, would set the run's memory peak. Unset train.eval_batch_size to "
             f"batch evaluation as the training{budget} is batched, or lower it to {fits}.")]


def check_completion_stop(recipe: Recipe, tokenizer) -> list[Check]:
    """Online RL: where the template's end of turn is text of several tokens, whether the samplers can stop at it
    (chat.turn_tokens); nothing to say where it is one token."""
    from llmtrain.data.chat import text_turn, turn_tokens

    if not (turn := text_turn(tokenizer, _end_of_turn(recipe, tokenizer))):
        return []
    if turn_tokens(tokenizer, turn):
        return [("completion stop", "pass", f"completions stop at the template's {turn!r}, text of several tokens "
                 "here, where they are drawn")]
    return [("completion stop", "warn", f"the template ends a reply with {turn!r}, which this tokenizer splits into "
             "pieces that change with the text before it: completions stop only at EOS, most at "
             f"rl.max_completion_tokens={recipe.rl.max_completion_tokens}. Use a template whose end of turn is a "
             "token of the tokenizer, or that ends each reply with its eos_token")]


def check_prompt_room(recipe: Recipe, train, eval_ds) -> list[Check]:
    """Online RL, and distillation's on-policy steps: every prompt leaves room for the completion sampled after it
    (rl.max_completion_tokens, distill.max_completion_tokens) within data.max_seq_len (a prompt is never cut: its end
    is what the completion continues). A distillation row's prompt is its tokens before the first trained one (its
    own completion is what the student's replaces); without the check its sequences grew past data.max_seq_len, which
    the estimate prices and pipeline stages hold in rows of. Fails naming the file and the first rows."""
    d = recipe.data
    key, most = (("rl.max_completion_tokens", recipe.rl.max_completion_tokens) if recipe.rl is not None else
                 ("distill.max_completion_tokens", recipe.distill.max_completion_tokens))
    room = d.max_seq_len - most
    rows = []
    for name, ds, where in (("train", train, d.path), ("eval", eval_ds, d.eval_split)):
        if ds is None or not len(ds):
            continue
        prompts = list(zip(ds["row"], ds["length"] if recipe.rl is not None else
                           (prompt_length(labels) for labels in ds["labels"])))
        long = [(r + 1, n) for r, n in prompts if n > room]
        if long:
            shown = ", ".join(f"row {r} ({n} tokens)" for r, n in long[:5]) + (", ..." if len(long) > 5 else "")
            need = max(n for _, n in long) + most
            return [("prompt room", "fail", f"{len(long)} {name} prompts in {where} leave no room for "
                     f"{key}={most} within data.max_seq_len={d.max_seq_len}: {shown}. Raise data.max_seq_len to "
                     f"{need}, lower {key}, or remove those rows.")]
        rows.append(f"{name}: the longest prompt {max(n for _, n in prompts)} tokens")
    return [("prompt room", "pass", "; ".join(rows) + f" + {key}={most} <= data.max_seq_len={d.max_seq_len}")]


def _end_of_turn(recipe: Recipe, tokenizer) -> str | None:
    """The template's end of turn where the data is rendered with one (None where it is not, or cannot render:
    check_chat_template says why)."""
    if not needs_chat(recipe):
        return None
    from llmtrain.data.chat import end_of_turn, read_template

    try:
        return end_of_turn(tokenizer, read_template(recipe.data, tokenizer)) or None
    except LLMTrainError:
        return None


def check_context(max_seq_len: int, max_positions: int | None) -> list[Check]:
    """data.max_seq_len against the model's max_position_embeddings: longer examples train positions the model
    was never trained on (RoPE extrapolates poorly), silently."""
    if max_positions and max_seq_len > max_positions:
        return [("context", "warn", f"data.max_seq_len={max_seq_len} is longer than the model's "
                 f"max_position_embeddings={max_positions}: examples past {max_positions} tokens train positions the "
                 f"model never saw. Lower data.max_seq_len to {max_positions}, or extend the context on purpose with "
                 f"model.rope_scaling (e.g. {{rope_type: yarn, factor: {math.ceil(max_seq_len / max_positions)}}}).")]
    return [("context", "pass", f"data.max_seq_len={max_seq_len} within max_position_embeddings={max_positions}")
            ] if max_positions else []


def check_warmup(warmup: int, total_steps: int) -> list[Check]:
    """train.warmup_steps at or past the run's length trains on the warm-up ramp alone (a recipe shortened with
    max_steps for a smoke test): the peak lr is never reached and there is no decay."""
    if warmup and warmup >= total_steps:
        return [("schedule", "warn", f"train.warmup_steps={warmup} is not below the run's {total_steps} steps: every "
                 "step is on the warm-up ramp, the peak train.lr is never reached and nothing decays. "
                 + (f"Lower train.warmup_steps (e.g. to {total_steps // 10}) or raise train.max_steps."
                    if total_steps // 10 else "Set train.warmup_steps=0 or raise train.max_steps."))]
    return [("schedule", "pass", f"{warmup} warm-up step{'s' * (warmup != 1)} of {total_steps}")]


MANY_EPOCHS = 10  # passes over the data past which a supervised run is warned it will memorise it


def check_epochs(recipe: Recipe, *, steps_per_epoch: int, examples: int, sources=None) -> list[Check]:
    """train.max_steps far past the data (a handful of rows trained for hundreds of steps): the model memorises
    them, silently; its final/ is the last step, not the best. Online RL samples new completions of the same prompts
    every pass, so it is not warned. `sources`: a mixture's rows' source column, whose epoch is its quotas' sum and
    whose rows each source reads its quota / rows times an epoch (the warning had counted every row once an epoch:
    "100 passes" where the rows were read 6 to 8 times, and none for a one-row source weighted 0.9, read 287 times)."""
    t = recipe.train
    if not t.max_steps or recipe.rl is not None or steps_per_epoch <= 0:
        return []
    epochs = t.max_steps / steps_per_epoch
    if sources is not None:
        from llmtrain.data.mixture import Mixture, label, source_sizes

        mix = Mixture.of(recipe.data.sources, source_sizes(sources))
        most, source = max(zip((epochs * r for r in mix.reads), recipe.data.sources), key=lambda r: r[0])
        if most <= MANY_EPOCHS:
            return []
        return [("epochs", "warn", f"train.max_steps={t.max_steps} reads each row of {label(source)} about "
                 f"{most:,.0f} times ({epochs:,.1f} epochs of the mixture's {mix.examples:,} examples): the model "
                 "will learn them by heart (eval loss rises while train loss falls; final/ is the last step, not the "
                 "best). Lower train.max_steps or that source's share, or add data.")]
    if epochs <= MANY_EPOCHS:
        return []
    steps = f"{steps_per_epoch:,} step{'s' if steps_per_epoch != 1 else ''}"
    return [("epochs", "warn", f"train.max_steps={t.max_steps} is {epochs:,.0f} passes over the {examples:,} train "
             f"examples ({steps} an epoch): the model sees each one {epochs:,.0f} times and will learn them by "
             "heart (eval loss rises while train loss falls; final/ is the last step, not the best). Lower "
             "train.max_steps, or add data.")]


def total_steps(recipe: Recipe, lengths: list[int], *, world: int, sources=None, plan=None) -> int:
    """The run's optimizer steps: train.max_steps, else its epochs over the data plan (as finetune counts them;
    `plan`: that plan, where the caller has it)."""
    t = recipe.train
    if t.max_steps:
        return t.max_steps
    plan = plan or data_plan(recipe, lengths, world=world, sources=sources)
    return plan.steps_in(t.epochs, t.grad_accum_steps) * updates_per_window(recipe)


def data_plan(recipe: Recipe, lengths: list[int], *, world: int, sources=None):
    """The run's batching.DataPlan over examples of these lengths, as finetune builds it; `sources`: a mixture's
    `source` column (data.sources: the plan follows the mixture's order, data/mixture.py)."""
    from llmtrain.data.batching import DataPlan
    from llmtrain.data.mixture import Mixture, source_sizes

    t = recipe.train
    mixture = None
    if recipe.data.sources is not None:
        if sources is None:
            raise ValueError("a mixture's data plan needs its rows' sources")
        mixture = Mixture.of(recipe.data.sources, source_sizes(sources))
    return DataPlan(lengths, seed=t.seed, world=world, micro_batch_size=t.micro_batch_size,
                    micro_batch_tokens=t.micro_batch_tokens, mixture=mixture)


def load_data(recipe: Recipe, tokenizer, *, world: int = 1, rows: int | None = None) -> list[Check]:
    """prepare_datasets (filling the cache finetune reads) and check_data; when preparing refuses, tokenise the
    train split alone to say why (all examples dropped gives stats with 0 examples)."""
    from llmtrain.data.prepare import prepare_recipe, tokenize_dataset
    from llmtrain.data.tools import prompt_tools
    from llmtrain.data.sources import load_raw

    refusal = None  # finetune's refusal, where the train split alone prepares (the eval split's, say)
    try:
        train, eval_ds, stats, _ = prepare_recipe(recipe, tokenizer)
        stats = stats["train"]
    except LLMTrainError as first:
        if recipe.data.sources is not None:
            return [("data", "fail", str(first))]
        try:
            train, stats = tokenize_dataset(load_raw(recipe.data.path, name=recipe.data.name,
                                                     split=recipe.data.split), tokenizer, recipe.data, "data.path",
                                           tools=prompt_tools(recipe))
            eval_ds, refusal = None, str(first)
        except LLMTrainError:
            return [("data", "fail", str(first))]
    rows = check_data(recipe, stats, train, eval_ds, tokenizer, rows=rows)
    if refusal is not None and not any(status == "fail" for _, status, _ in rows):
        # the train split's checks do not say why finetune refuses (a missing or malformed eval file passed, told
        # it had no eval data): its refusal is the data row's
        rows = [("data", "fail", refusal)] + [r for r in rows if r[0] not in ("data", "no eval")]
    if not len(train):
        return rows
    t = recipe.train
    mixed = train["source"] if recipe.data.sources is not None else None
    rows += check_warmup(t.warmup_steps, total_steps(recipe, train["length"], world=world, sources=mixed))
    if t.max_steps:
        try:
            per_epoch = data_plan(recipe, train["length"], world=world, sources=mixed).steps_per_epoch(
                0, t.grad_accum_steps)
        except ValueError:  # a token budget below an example: check_data has said so
            return rows
        rows += check_epochs(recipe, steps_per_epoch=per_epoch, examples=len(train), sources=mixed)
    return rows
