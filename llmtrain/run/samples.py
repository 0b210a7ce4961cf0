"""Sample generations at eval (train.eval_samples): the first eval prompts decoded greedily, beside the expected
completion. This is what people read first to see whether a fine-tune works.

An example is a tokenised eval row: the expected completion is its last trained run (its last reply), the prompt
everything before it (what inference gives the model for that reply). With
data.train_on_prompt or the text format nothing is masked: the prompt is then the first token (BOS) alone, and
the sample shows what the model writes from nothing.

How generation runs inside training:
- transformers' own forward and `generate` (llmtrain's loss forward runs only when called with loss_index);
  greedy, one prompt at a time (no padding, so a sample is exactly what the model says to that prompt alone).
- llmtrain's varlen attention has no KV cache: while generating, the model attends with SDPA (the same math
  on one unpacked sequence) and uses the cache; the attention is switched back afterwards.
- torch.compile (model.compile) is bypassed: every new length would be a recompile.
- several processes: every process calls this with the same examples and `synced=True`. Under FSDP each
  forward all-gathers the shards of every rank, so all ranks must run the same number of forwards; transformers'
  synced_gpus keeps a rank that reached EOS stepping until all have. Under DDP the ranks generate the same
  text in parallel (no extra wall time). Only the main process writes (MetricsLog.write_samples).
"""

from __future__ import annotations

from contextlib import contextmanager

from llmtrain.data.formats import IGNORE, prompt_length
from llmtrain.model.generate import Stops, cached_attention, stop_tokens
from llmtrain.model.loss import causal_lm
from llmtrain.objectives.rewards import answer


def split_example(example) -> tuple[list[int], list[int]]:
    """(prompt ids, expected ids) of a tokenised row {"input_ids", "labels"} (a preference pair: its chosen answer):
    the expected text is the row's last trained run (its last reply and end of turn: a multi-turn or tool-calling
    chat's final answer), the prompt everything before it (the earlier turns, a tool's results), as inference
    gives it. The expected text had been the rest of the row after its first prompt, user turns and tool results
    included, which no reply can match. With nothing masked the first token (BOS) is the prompt: generation needs
    one token to continue from."""
    ids_key, labels_key = ("input_ids", "labels") if "input_ids" in example else ("chosen_ids", "chosen_labels")
    ids, labels = list(example[ids_key]), list(example[labels_key])
    trained = [k for k, label in enumerate(labels) if label != IGNORE]
    if not trained:
        n = max(prompt_length(labels), 1)
        return ids[:n], ids[n:]
    end = start = trained[-1] + 1
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    n = max(start, 1)
    return ids[:n], ids[n:end]


def generate_samples(model, tokenizer, examples, *, max_new_tokens: int, step: int, synced: bool = False,
                     expected: list[str] | None = None, stops=None, pipeline=None) -> list[dict]:
    """Greedy generations for `examples`: [{"step", "index", "prompt", "expected", "generated"}], texts decoded
    without special tokens. `model` is the unwrapped model (accelerator.unwrap_model; peft models too). `expected`:
    the expected texts where the rows hold none (online RL's prompts: their answer column); `stops`: where a reply
    ends (generate.Stops: objective.stop_ids, the template's end of turn too; default the model's end tokens and
    EOS), an end of turn of several tokens as transformers' stop string. `pipeline`: pipeline stages
    (parallel/pipeline/schedule.Pipeline), which decode through the stages (`_on_stages`)."""
    import torch

    if pipeline is not None:
        return _on_stages(pipeline, tokenizer, examples, max_new_tokens=max_new_tokens, step=step, expected=expected,
                          stops=stops)

    lm = causal_lm(model)
    own = stop_tokens(lm, tokenizer)  # the model's end tokens first, in their order (pad falls back to the first)
    stops = Stops(own) if stops is None else stops
    eos = [*(t for t in own if t in stops), *sorted(stops.difference(own))]
    ends = {"stop_strings": [stops.text], "tokenizer": tokenizer} if stops.text else {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    was_training = model.training
    model.eval()
    samples = []
    try:
        with torch.no_grad(), cached_attention(lm), _gathered(model), torch.compiler.set_stance("force_eager"):
            for index, example in enumerate(examples):
                prompt, expected_ids = split_example(example)
                input_ids = torch.tensor([prompt], dtype=torch.long, device=lm.device)
                # Sampling settings of the model's generation_config (temperature, top_p: Llama-2-chat has
                # them) are cleared: greedy ignores them, and transformers would warn that it does.
                out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                     max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                                     top_k=None, use_cache=True, eos_token_id=eos, pad_token_id=pad,
                                     synced_gpus=synced, **ends)
                samples.append(_record(tokenizer, step, index, prompt, out[0, len(prompt):].tolist(),
                                       expected[index] if expected is not None else expected_ids, stops))
    finally:
        model.train(was_training)
    return samples


def _on_stages(pipeline, tokenizer, examples, *, max_new_tokens: int, step: int, expected, stops) -> list[dict]:
    """generate_samples on pipeline stages: every process of each pipeline decodes the same prompts through the
    stages with the KV cache (parallel/pipeline/sampling.py), greedily and one prompt at a time, as generate does on
    one process; stops: where a reply ends (objective.stop_ids's, which the loop passes)."""
    from llmtrain.model.generate import sample

    stops = Stops.of(stops)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    samples = []
    with pipeline.sampling() as lm:
        for index, example in enumerate(examples):
            prompt, expected_ids = split_example(example)
            generated = sample(lm, [prompt], seeds=[0], max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
                               stop_ids=stops, pad_id=pad)[0]
            samples.append(_record(tokenizer, step, index, prompt, generated,
                                   expected[index] if expected is not None else expected_ids, stops))
    return samples


def _record(tokenizer, step: int, index: int, prompt: list[int], generated: list[int], expected, stops) -> dict:
    """One sample's line of samples.jsonl, texts decoded without special tokens; `expected`: the text given, or the
    row's expected ids, read as a reply (its end of turn left out)."""
    reference = expected if isinstance(expected, str) else stops.reply(_text(tokenizer, expected))
    return {"step": step, "index": index, "prompt": _text(tokenizer, prompt), "expected": reference,
            "generated": stops.reply(_text(tokenizer, generated))}


def mark_answers(samples: list[dict], pattern: str | None) -> float | None:
    """Add to each sample its extracted answers and whether the generated one is the expected one; the share of
    samples whose generated answer matches (None without samples). A generated reply without an answer is wrong."""
    for s in samples:
        s["expected_answer"], s["generated_answer"] = answer(s["expected"], pattern), answer(s["generated"], pattern)
        s["match"] = s["generated_answer"] is not None and s["generated_answer"] == s["expected_answer"]
    return sum(s["match"] for s in samples) / len(samples) if samples else None


def format_sample(sample: dict, *, width: int = 240) -> str:
    """The console lines for one sample, each on one line and shortened (the prompt keeps its end, next to the
    answer)."""
    prompt, expected, generated = (" ".join(sample[k].split()) for k in ("prompt", "expected", "generated"))
    if len(prompt) > width:
        prompt = "..." + prompt[-width:]
    expected, generated = (t if len(t) <= width else t[:width] + "..." for t in (expected, generated))
    return (f"sample at step {sample['step']}:\n  prompt:    {prompt}\n  expected:  {expected}\n"
            f"  generated: {generated}")


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@contextmanager
def _gathered(model):
    """FSDP2: gather the root's own parameters (embeddings, ...) for the whole generation. `generate` of a peft
    model calls the inner model, never the root's forward, so the root's hook would not gather them; each
    decoder layer still gathers its own at each forward, as in training."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
