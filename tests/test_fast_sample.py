"""The fast sampler (model/fast_sample.py) against the reference loop (model/generate.sample), its oracle. The two
attention paths give logits equal up to rounding (~1e-6), so their completions are equal up to rounding: at scale
a sample can cross a CDF boundary, and the at-scale test measures the agreement rate. The small cases (every
temperature and top_p, prompts of mixed lengths, completions that stop early and ones that hit the limit, LoRA on
and off, a 4-bit base, a sliding window) agree token for token, and would not with a wrong mask, position or cache
slot. Exact: a completion does not depend on its batch; each distinct prompt is prefilled once; models the fast
sampler cannot run sample with the reference loop. CPU, in-process (the CUDA graph is tested in test_cuda.py)."""

from __future__ import annotations

import random

import pytest
import torch

from llmtrain.model.fast_sample import sample_fast, sampler_for, supports
from llmtrain.model.generate import completion_seed, sample

STOP = 2  # the tiny tokenizer's EOS


def mixed_prompts(n_prompts: int, generations: int, *, seed: int = 0) -> list[list[int]]:
    """`n_prompts` prompts of 3 to 20 tokens (BOS first), each repeated `generations` times, as a rollout asks."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(4, 90) for _ in range(rng.randrange(2, 20))] for _ in range(n_prompts)]
    return [p for p in prompts for _ in range(generations)]


def both(lm, prompts, *, stop_ids=frozenset({STOP}), **kwargs):
    seeds = [completion_seed(7, 3, i // 4, i % 4) for i in range(len(prompts))]
    kwargs = dict(seeds=seeds, stop_ids=set(stop_ids), pad_id=3, **kwargs)
    return sample(lm, prompts, **kwargs), sample_fast(lm, prompts, **kwargs)


@pytest.fixture(scope="module")
def lm(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lora_lm(tiny_assets):
    """The tiny model under an all-linear LoRA whose B is not zero (a trained adapter changes the tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.eval()


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_on_small_cases_the_fast_sampler_draws_the_reference_loops_tokens(lm, temperature, top_p):
    prompts = mixed_prompts(6, 4)
    kwargs = dict(max_new_tokens=24, temperature=temperature, top_p=top_p)
    _, free = both(lm, prompts, stop_ids=set(), **kwargs)  # nothing stops: every completion is 24 long
    stops = {free[0][6], free[-1][2]}  # tokens some completions draw: they stop those early
    reference, fast = both(lm, prompts, stop_ids=stops, **kwargs)
    assert fast == reference
    assert any(len(c) < 24 for c in fast) and any(len(c) == 24 and c[-1] not in stops for c in fast)
    assert len({len(p) for p in prompts}) > 3  # mixed lengths: left padding differs row to row


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 0, 1.0, 0.1), (1.0, 0, 0.8, 0.0), (1.3, 20, 0.9, 0.05), (1.0, 40, 0.5, 0.2),
    (1.0, 1000, 1.0, 0.0), (1.0, 0, 0.0, 0.0)])  # top_p 0: the most likely token alone, as min_tokens_to_keep
def test_the_filters_keep_what_transformers_warpers_keep_with_the_same_probabilities(temperature, top_k, top_p, min_p):
    """generate.filtered_probs, renormalised, against transformers' own warpers in generate's order (temperature,
    top_k, top_p, min_p) and a softmax: the same tokens kept, their probabilities to 1e-6; rows both flat and peaked
    (min_p's threshold moves with the top token)."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from llmtrain.model.generate import filtered_probs

    torch.manual_seed(0)
    logits = torch.randn(16, 97) * torch.linspace(0.5, 6.0, 16)[:, None]  # flat to peaked rows
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    expected = torch.softmax(LogitsProcessorList(warpers)(None, logits.clone()), dim=-1)
    got = filtered_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert torch.equal(got > 0, expected > 0)
    assert (got / got.sum(-1, keepdim=True) - expected).abs().max() < 1e-6
    kept = (got > 0).sum(-1)
    assert kept.min() >= 1 and (kept < 97).any() == (top_k < 97 or top_p < 1 or min_p > 0)


def test_a_uniform_of_one_draws_a_token_the_filters_keep():
    """A float32 uniform can be exactly 1.0 (a float64 draw within 2^-25 of 1: about one in 3e7 tokens); its target
    at the distribution's total had passed every token, and the clamp took the last id whatever its probability
    (one top_k cut, a log-probability of -inf). It draws the last token the filters keep now; every uniform below
    1 draws what it drew."""
    from llmtrain.model.generate import next_tokens

    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0, -2.0], [0.5, 3.0, 2.0, -4.0, 1.0]])
    for filters in (dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), {}):
        sampling = dict(temperature=1.0, top_p=1.0) | filters
        logps = torch.empty(2)
        picked = next_tokens(logits, torch.tensor([1.0, 1.0]), logps=logps, **sampling)
        kept = filtered_probs_of(logits, **sampling) > 0
        last_kept = [int(row.nonzero().max()) for row in kept]
        assert picked.tolist() == last_kept and torch.isfinite(logps).all(), (filters, picked, logps)
        below = torch.tensor([0.999, 0.3])  # below 1: the inverse CDF as before
        cdf = filtered_probs_of(logits, **sampling).cumsum(-1)
        expected = torch.searchsorted(cdf, (below * cdf[:, -1])[:, None], right=True).squeeze(-1)
        assert torch.equal(next_tokens(logits, below, **sampling), expected)
    assert next_tokens(logits, torch.tensor([0.0, 0.5]), temperature=1.0, top_p=0.0).tolist() == [0, 1]  # greedy


def filtered_probs_of(logits, **sampling):
    from llmtrain.model.generate import filtered_probs

    return filtered_probs(logits, **sampling)


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(min_p=0.6), dict(top_k=8, top_p=0.9, min_p=0.05)])
def test_top_k_and_min_p_draw_the_reference_loops_tokens_and_top_k_1_is_greedy(lm, filters):
    """Both samplers cut the distribution alike (their tokens equal), the cut changes what is drawn, and top_k 1 at
    temperature 1 draws the argmax: every completion is the greedy one."""
    prompts = mixed_prompts(4, 4)
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_p=filters.get("top_p", 1.0))
    extra = {k: v for k, v in filters.items() if k != "top_p"}
    reference = sample(lm, prompts, seeds=list(range(16)), stop_ids=set(), pad_id=3, **kwargs, **extra)
    fast = sample_fast(lm, prompts, seeds=list(range(16)), stop_ids=set(), pad_id=3, **kwargs, **extra)
    assert fast == reference
    assert fast != sample_fast(lm, prompts, seeds=list(range(16)), stop_ids=set(), pad_id=3, **kwargs)
    greedy = sample_fast(lm, prompts, seeds=list(range(16)), stop_ids=set(), pad_id=3, max_new_tokens=16,
                         temperature=0.0, top_p=1.0)
    assert sample_fast(lm, prompts, seeds=list(range(16)), stop_ids=set(), pad_id=3, max_new_tokens=16,
                       temperature=1.0, top_p=1.0, top_k=1) == greedy


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_the_repetition_penalty_is_transformers_processor_and_both_samplers_apply_it_alike(lm, penalty, monkeypatch):
    """generate.repetition_penalized against transformers' RepetitionPenaltyLogitsProcessor on rows that repeat
    tokens (to 1e-6); both samplers draw the same tokens under it at temperature 1, stops ending some rows early
    (finished rows leave the fast sampler's batch with their seen tokens) and greedy; it changes what is drawn, and
    at 2 greedy completions repeat fewer of their tokens than without it."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from llmtrain.model.generate import repetition_penalized, seen_tokens

    torch.manual_seed(0)
    logits, ids = torch.randn(6, 97) * 3, torch.randint(0, 97, (6, 30))
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = repetition_penalized(logits, seen_tokens(ids.tolist(), 97, "cpu"), penalty)
    assert (got - expected).abs().max() < 1e-6 and not torch.equal(got, logits)

    from llmtrain.model import fast_sample

    prompts = mixed_prompts(4, 4)
    kwargs = dict(max_new_tokens=24, temperature=1.0, top_p=1.0, repetition_penalty=penalty)
    _, free = both(lm, prompts, stop_ids=set(), **kwargs)
    stops = {free[0][6], free[-1][2]}
    monkeypatch.setattr(fast_sample, "CHECK_EVERY", 4)  # a look every 4 tokens, and any finished row leaves
    monkeypatch.setattr(fast_sample, "COMPACT_AT", 0.99)
    compacted, compact = [], fast_sample._Decode.compact
    monkeypatch.setattr(fast_sample._Decode, "compact",
                        lambda self, live, filled: compacted.append(live.numel()) or compact(self, live, filled))
    reference, fast = both(lm, prompts, stop_ids=stops, **kwargs)
    assert fast == reference and any(len(c) < 20 for c in fast) and compacted
    assert fast != both(lm, prompts, stop_ids=stops, **{**kwargs, "repetition_penalty": 1.0})[1]
    greedy = dict(max_new_tokens=24, temperature=0.0, top_p=1.0)
    reference, fast = both(lm, prompts, stop_ids=set(), **greedy, repetition_penalty=penalty)
    assert fast == reference
    if penalty > 1:
        def repeats(rows):
            return sum(len(c) - len(set(c)) for c in rows)

        _, penalised = both(lm, prompts, stop_ids=set(), **greedy, repetition_penalty=2.0)
        _, plain = both(lm, prompts, stop_ids=set(), **greedy)
        assert repeats(penalised) < repeats(plain)


@pytest.mark.parametrize("adapter", ["on", "off"])
def test_lora_on_small_cases_draws_the_reference_loops_tokens_with_the_adapter_on_and_off(lora_lm, lm, adapter):
    prompts = mixed_prompts(4, 4, seed=1)
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_p=0.9)
    if adapter == "on":
        reference, fast = both(lora_lm, prompts, **kwargs)
        assert fast != both(lm, prompts, **kwargs)[1]  # the adapter is in the sampled tokens
    else:
        with lora_lm.disable_adapter():
            reference, fast = both(lora_lm, prompts, **kwargs)
        assert fast == both(lm, prompts, **kwargs)[1]  # adapter off: the base model's tokens
    assert fast == reference


def test_each_distinct_prompt_is_prefilled_once_and_a_completion_does_not_depend_on_its_batch(lm, monkeypatch):
    """The prefill embeds 3 rows for 3 prompts x 4 generations; a completion sampled alone, or among other
    prompts, is the same (its seed and prompt decide it)."""
    prompts = mixed_prompts(3, 4, seed=2)
    seeds = [completion_seed(7, 0, i // 4, i % 4) for i in range(12)]
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, stop_ids={STOP}, pad_id=3)
    rows_embedded = []
    embed = lm.model.embed_tokens.forward
    monkeypatch.setattr(lm.model.embed_tokens, "forward", lambda ids: rows_embedded.append(ids.shape) or embed(ids))
    together = sample_fast(lm, prompts, seeds=seeds, **kwargs)
    assert rows_embedded[0] == (3, max(map(len, prompts)))  # the prefill: one row per distinct prompt
    assert all(shape == (12, 1) for shape in rows_embedded[1:])  # then one token per completion
    assert sample_fast(lm, prompts[5:6], seeds=seeds[5:6], **kwargs) == together[5:6]
    assert sample_fast(lm, prompts[::-1], seeds=seeds[::-1], **kwargs) == together[::-1]


def _with_logits(module: str, fn, monkeypatch, *args, **kwargs) -> tuple[list[list[int]], list[torch.Tensor]]:
    """fn's completions, and the logits [rows, vocab] it drew each token from (step by step), read where `module`
    calls next_tokens."""
    from llmtrain.model.generate import next_tokens

    seen = []
    monkeypatch.setattr(f"{module}.next_tokens", lambda logits, *a, **k: seen.append(logits.clone())
                        or next_tokens(logits, *a, **k))
    return fn(*args, **kwargs), seen


def test_at_scale_the_fast_sampler_agrees_with_the_reference_up_to_rounding_and_each_is_batch_independent(
        lm, monkeypatch):
    """What is exact and what is not, measured on a GRPO-sized rollout (32 prompts x 16 completions at temperature
    0.5, fp32, CPU). Exact, for each sampler: a completion does not depend on its batch (the rollout in micro-batches
    of 4 prompts gives the same 512 completions as in one of 32). Up to rounding: the fast sampler's attention path
    (static cache, SDPA over its slots) and the reference loop's (transformers' growing cache) give logits that
    differ in the last bits, so a uniform that falls within that distance of a CDF boundary draws the neighbouring
    token, and the completion differs from there on (measured on the tiny GRPO recipe's first step: 1 of 256). So
    the bound is on the agreement rate, with the logits' distance where the completions still agree."""
    prompts = mixed_prompts(32, 16, seed=11)
    seeds = [completion_seed(42, 0, i // 16, i % 16) for i in range(len(prompts))]
    kwargs = dict(seeds=seeds, max_new_tokens=16, temperature=0.5, top_p=1.0, stop_ids={STOP}, pad_id=3)
    reference, ref_logits = _with_logits("llmtrain.model.generate", sample, monkeypatch, lm, prompts, **kwargs)
    fast, fast_logits = _with_logits("llmtrain.model.fast_sample", sample_fast, monkeypatch, lm, prompts, **kwargs)
    for fn, together in ((sample, reference), (sample_fast, fast)):
        apart = [c for k in range(0, len(prompts), 64)
                 for c in fn(lm, prompts[k:k + 64], **{**kwargs, "seeds": seeds[k:k + 64]})]
        assert apart == together  # exact: micro-batches of 4 prompts x 16 completions draw what one of 32 does
    same = sum(f == r for f, r in zip(fast, reference)) / len(prompts)
    # the logits of each step where both completions are still going and have drawn the same tokens so far
    diff = max((f[i] - r[i]).abs().max().item() for t, (f, r) in enumerate(zip(fast_logits, ref_logits))
               for i in range(len(prompts)) if min(len(fast[i]), len(reference[i])) > t
               and fast[i][:t] == reference[i][:t])
    print(f"fast vs reference: {same:.2%} of {len(prompts)} completions identical; logits within {diff:.1e}")
    assert same >= 0.95 and diff < 1e-4
    assert sum(map(len, fast)) > 10 * len(prompts)  # long enough completions that a boundary could be crossed


def test_attention_over_spans_of_the_cache_gives_the_same_tokens(lm, monkeypatch):
    """A decode step attends to the cache's slots up to the next multiple of SPAN (256: early tokens do not read the
    whole cache); with spans of 8 slots, prompts and completions cross several of them, and the tokens are the
    reference loop's."""
    monkeypatch.setattr("llmtrain.model.fast_sample.SPAN", 8)
    prompts = mixed_prompts(4, 3, seed=6)
    reference, fast = both(lm, prompts, max_new_tokens=30, temperature=1.0, top_p=1.0)
    assert fast == reference and max(map(len, fast)) == 30


def test_a_step_that_cannot_be_captured_samples_eagerly_with_a_warning_and_the_same_tokens(lm, monkeypatch):
    """rl.sampler=graph where a kernel cannot be captured: the rollout goes on eagerly (what CUDA would do, played on
    the CPU with a capture that fails)."""
    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("llmtrain.model.fast_sample._can_capture", lambda device: True)
    monkeypatch.setattr("llmtrain.model.fast_sample._captured", refuse)
    prompts = mixed_prompts(3, 2, seed=7)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph .operation not permitted"):
        captured = sample_fast(lm, prompts, seeds=list(range(6)), max_new_tokens=10, temperature=1.0, top_p=1.0,
                               stop_ids={STOP}, pad_id=3, capture=True)
    assert captured == sample(lm, prompts, seeds=list(range(6)), max_new_tokens=10, temperature=1.0, top_p=1.0,
                              stop_ids={STOP}, pad_id=3)


def test_a_one_token_limit_and_no_stop_tokens(lm):
    prompts = mixed_prompts(2, 2, seed=3)
    reference, fast = both(lm, prompts, max_new_tokens=1, temperature=1.0, top_p=1.0)
    assert fast == reference and all(len(c) == 1 for c in fast)
    seeds = list(range(4))
    kwargs = dict(seeds=seeds, max_new_tokens=9, temperature=1.0, top_p=1.0, stop_ids=set(), pad_id=3)
    free = sample_fast(lm, prompts, **kwargs)
    assert free == sample(lm, prompts, **kwargs) and all(len(c) == 9 for c in free)


def first_end(row: list[int], sequences) -> list[int]:
    """`row` cut after the first place one of `sequences` is complete in it (all of it where none is)."""
    for k in range(len(row)):
        if any(tuple(row[max(0, k + 1 - len(s)):k + 1]) == s for s in sequences):
            return row[:k + 1]
    return row


@pytest.mark.parametrize("compact", [True, False])
def test_an_end_of_turn_of_several_tokens_stops_both_samplers_at_its_last_token(lm, compact):
    """A template's end of turn the tokenizer splits into several tokens (Stops.sequences: `<|im_end|>` in a template
    for a tokenizer without it) ends a completion where its last token is drawn, in the reference loop and in the
    fast sampler (on the device, no host sync: compared in place, with finished rows leaving the batch or not),
    as drawing nothing but the completion up to there: the free completion cut there."""
    from llmtrain.model.generate import Stops

    prompts = mixed_prompts(6, 4, seed=5)
    seeds = [completion_seed(7, 3, i // 4, i % 4) for i in range(len(prompts))]
    kwargs = dict(seeds=seeds, max_new_tokens=40, temperature=1.0, top_p=1.0, pad_id=3)
    free = sample(lm, prompts, stop_ids=set(), **kwargs)  # nothing stops: every completion is 40 long
    sequences = [tuple(free[0][9:11]), tuple(free[-1][20:23])]  # runs some completions draw, of 2 and 3 tokens
    expected = [first_end(c, sequences) for c in free]
    assert sum(len(c) < 40 for c in expected) >= 2 and any(len(c) == 40 for c in expected)
    stops = Stops((), sequences, "")
    assert sample(lm, prompts, stop_ids=stops, **kwargs) == expected
    assert sample_fast(lm, prompts, stop_ids=stops, compact=compact, **kwargs) == expected


def test_a_sliding_window_shorter_than_the_sequence_is_applied_as_the_reference_applies_it(tiny_assets):
    """A Mistral with a 6-token window: prompts and completions longer than it attend to the last 6 slots only."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6, max_position_embeddings=128)
    mistral = MistralForCausalLM(config).eval()
    assert supports(mistral)
    reference, fast = both(mistral, mixed_prompts(3, 2, seed=4), max_new_tokens=12, temperature=1.0, top_p=1.0)
    assert fast == reference
    config.sliding_window = None  # the window changes the tokens: it is applied, not ignored
    assert both(mistral, mixed_prompts(3, 2, seed=4), max_new_tokens=12, temperature=1.0, top_p=1.0)[1] != fast


FAMILIES = {  # each with a window shorter than its sequences where the family has one
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),  # QK-norm, tied as below 8B
    "qwen2": dict(attention_bias=True),
    "phi3": dict(partial_rotary_factor=0.75, sliding_window=6, pad_token_id=0),  # fused projections, every layer
    # local layers with a window and their own RoPE base, a global one: scaled embeddings, QK-norm, four norms
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                        layer_types=["sliding_attention", "full_attention"]),
    # attention sinks (drawn below), a window on every other layer, 4 experts with biases of which 2 a token
    "gpt_oss": dict(head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2),
    # per-layer embeddings, a local layer with a window, global layers of their own head size, the last layer reading
    # the keys and values of the global one before it (kv sharing), the logits capped
    "gemma4_text": dict(head_dim=16, global_head_dim=32, sliding_window=6, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=100, num_hidden_layers=3, num_kv_shared_layers=1,
                        layer_types=["sliding_attention", "full_attention", "full_attention"],
                        final_logit_softcapping=1.0),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_draws_the_reference_loops_tokens(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128), **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # Gemma's norms start at zero (weight + 1): move every norm, so that a wrong one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.3)
            if name.endswith(("sinks", "_bias")):  # GPT-OSS's sinks and experts' biases start near 0
                p.normal_()
    assert supports(model)
    prompts = mixed_prompts(3, 2, seed=4)
    reference, fast = both(model, prompts, max_new_tokens=12, temperature=1.0, top_p=1.0)
    assert fast == reference and sum(map(len, fast)) > 12
    if family == "gpt_oss":  # the sinks change the tokens: they are computed, not left out
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        assert both(model, prompts, max_new_tokens=12, temperature=1.0, top_p=1.0)[1] != fast
    if config.sliding_window:  # the window changes the tokens: it is applied, not ignored
        config.sliding_window = 1000  # longer than any sequence here
        assert both(model, prompts, max_new_tokens=12, temperature=1.0, top_p=1.0)[1] != fast


def test_gemma_4s_shared_layers_run_on_the_last_position_of_a_prefill():
    """Gemma 4's kv-sharing layers (its last ones) write no cache, so only their last position's output is read: a
    prefill runs them on that position alone (they had run on every prompt position, for Gemma 4 E2B 20 of its 35
    layers); a decode step on its one. The tokens are the reference loop's (the case above)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma4_text", **{**dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128), **FAMILIES["gemma4_text"]})
    model = AutoModelForCausalLM.from_config(config).eval()
    seen = {i: [] for i in range(3)}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].shape[1]))
    prompts = mixed_prompts(3, 2, seed=4)
    sample_fast(model, prompts, seeds=[completion_seed(7, 3, 0, i) for i in range(len(prompts))], stop_ids={STOP},
                pad_id=3, max_new_tokens=4, temperature=1.0, top_p=1.0)
    width = max(map(len, prompts))
    assert seen[0][0] == seen[1][0] == width > 1  # the storing layers: every prompt position (their cache)
    assert seen[2] == [1] * len(seen[2]) and len(seen[2]) == len(seen[0])  # the sharing one: the last, each call


def test_gemma_4s_mixture_of_experts_draws_the_reference_loops_tokens(monkeypatch):
    """Gemma 4's mixture-of-experts variant (4 experts, 2 a token, beside its dense MLP; its router and experts run
    inside transformers' layer), with the rest of the case above."""
    monkeypatch.setitem(FAMILIES, "gemma4_text", {**FAMILIES["gemma4_text"], "enable_moe_block": True,
                                                  "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32})
    test_each_family_draws_the_reference_loops_tokens("gemma4_text")


@pytest.mark.precision
def test_a_4bit_base_on_a_small_case_draws_the_reference_loops_tokens(tiny_assets):
    pytest.importorskip("bitsandbytes")
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.modeling import load_model

    cfg = ModelConfig(name_or_path=str(tiny_assets / "model"), dtype="bfloat16", quantize="nf4",
                      attn_implementation="sdpa")
    qlora = load_model(cfg, LoraConfig(r=4, alpha=8), compute_dtype=torch.bfloat16).eval()
    reference, fast = both(qlora, mixed_prompts(3, 2, seed=5), max_new_tokens=10, temperature=0.0, top_p=1.0)
    assert fast == reference and len(fast[0]) > 1


def test_models_the_fast_sampler_cannot_run_sample_with_the_reference_loop(lm):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.warns(UserWarning, match="this gpt2 model samples with the reference loop"):
        assert not supports(gpt2) and sampler_for(gpt2, "static") is sample
    assert sampler_for(lm, "reference") is sample
    fast, graph = sampler_for(lm, "static"), sampler_for(lm, "graph")
    assert fast.func is sample_fast and not fast.keywords["capture"] and graph.keywords["capture"]


# -- the generation copy (rl.merged_copy) and finished rows leaving the batch (issue 56)

def _stops_for(lm, prompts, seeds, *, n: int, tokens: int = 64) -> set[int]:
    """`n` tokens the model draws often here: with them as stop tokens, completions end at very different lengths."""
    from collections import Counter

    free = sample_fast(lm, prompts, seeds=seeds, max_new_tokens=tokens, temperature=1.0, top_p=1.0, stop_ids=set(),
                       pad_id=3)
    return {t for t, _ in Counter(t for c in free for t in c).most_common(n)}


def test_finished_rows_leave_the_batch_and_every_completion_is_the_same_as_without(lm, monkeypatch):
    """A GRPO-sized rollout (16 prompts x 8) whose completions end at lengths from 1 to 64: the decode batch drops
    its finished rows at the looks (16 tokens apart) once half of them or fewer are going, and every completion is
    the one drawn with all rows kept; so is each micro-batch's (what 2 processes or another micro_batch_size
    sample)."""
    from llmtrain.model import fast_sample

    prompts = mixed_prompts(16, 8, seed=12)
    seeds = [completion_seed(5, 2, i // 8, i % 8) for i in range(len(prompts))]
    stops = _stops_for(lm, prompts[:16], seeds[:16], n=4)
    kwargs = dict(seeds=seeds, max_new_tokens=64, temperature=1.0, top_p=1.0, stop_ids=stops, pad_id=3)
    batches = []
    compact = fast_sample._Decode.compact
    monkeypatch.setattr(fast_sample._Decode, "compact",
                        lambda self, live, filled: batches.append((len(self.rows), live.numel())) or
                        compact(self, live, filled))
    kept = sample_fast(lm, prompts, compact=False, **kwargs)
    assert batches == []
    dropped = sample_fast(lm, prompts, **kwargs)
    assert dropped == kept
    lengths = sorted(map(len, kept))
    print(f"completion lengths: min {lengths[0]}, median {lengths[64]}, max {lengths[-1]}; batches {batches}")
    assert lengths[0] < 16 and lengths[-1] == 64  # ends spread over the rollout
    assert len(batches) >= 2 and all(live <= rows // 2 for rows, live in batches)  # compacted, more than once
    apart = [c for k in range(0, len(prompts), 16)
             for c in sample_fast(lm, prompts[k:k + 16], **{**kwargs, "seeds": seeds[k:k + 16]})]
    assert apart == kept


def test_a_long_prompt_is_prefilled_in_chunks_with_the_same_tokens(lm, monkeypatch):
    """Prompts of 3 to 20 tokens prefilled 4 positions at a time (PREFILL_CHUNK): each chunk attends to the ones
    before it through the cache; the completions are the reference loop's."""
    monkeypatch.setattr("llmtrain.model.fast_sample.PREFILL_CHUNK", 4)
    prompts = mixed_prompts(4, 3, seed=8)
    seeds = list(range(12))
    kwargs = dict(seeds=seeds, max_new_tokens=20, temperature=1.0, top_p=1.0, stop_ids=set(), pad_id=3)
    reference = sample(lm, prompts, **kwargs)
    embedded = []
    embed = lm.model.embed_tokens.forward
    monkeypatch.setattr(lm.model.embed_tokens, "forward", lambda ids: embedded.append(tuple(ids.shape)) or embed(ids))
    assert sample_fast(lm, prompts, **kwargs) == reference
    width = max(map(len, prompts))
    assert embedded == [(4, 4)] * (width // 4) + [(4, width % 4)] * (width % 4 > 0) + [(12, 1)] * 19


@pytest.fixture(scope="module")
def lora_again(lora_lm):
    """lora_lm's weights as they were, for the tests that change them."""
    state = {k: v.clone() for k, v in lora_lm.state_dict().items()}
    yield lora_lm
    lora_lm.load_state_dict(state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merged_copy_is_peft_merge_and_unload_to_rounding(lora_lm, dtype):
    """Each adapted linear's copy (merged_copy.merged_weight) against the weight peft's own merge_and_unload writes:
    fp32 to 1e-6. In bf16 the copy is the exact fp32 sum rounded once, and peft's (the delta rounded to bf16, then
    added in bf16) within a bf16 step of the base's and the delta's sizes, the same entry for most entries."""
    import copy

    from llmtrain.model.merged_copy import adapted_linears, merged_weight

    model = copy.deepcopy(lora_lm).to(dtype)
    names = {m: n for n, m in model.named_modules()}
    ours = {names[m]: merged_weight(m) for m in adapted_linears(model)}
    assert len(ours) == 7 * len(model.base_model.model.model.layers)
    theirs = dict(copy.deepcopy(model).merge_and_unload().named_modules())
    same = []
    for name, weight in ours.items():
        peft = theirs[name.removeprefix("base_model.model.")].weight
        assert weight.dtype == peft.dtype == dtype
        module = model.get_submodule(name)
        delta = module.lora_B["default"].weight.float() @ module.lora_A["default"].weight.float() * module.scaling[
            "default"]
        exact = module.get_base_layer().weight.float() + delta
        if dtype == torch.float32:
            assert (weight - peft).abs().max().item() < 1e-6, name
        else:  # the copy: the fp32 sum rounded once; peft's: within a bf16 step of the base and of the delta
            assert torch.equal(weight, exact.to(dtype)), name
            bound = (module.get_base_layer().weight.float().abs() + delta.abs()) * 2**-7
            assert ((peft.float() - exact).abs() <= bound).all(), name
            same.append((peft == weight).float().mean().item())
    assert dtype == torch.float32 or 0.5 < min(same) < 1, same
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(ours["base_model.model.model.layers.0.self_attn.q_proj"], base)  # the adapters are in it


def _merged_against_unmerged(model, prompts, monkeypatch, **kwargs) -> tuple[list[list[int]], float, float]:
    """A rollout on the merged copy against one with the adapters unmerged: the merged one's completions, the share
    of identical completions, and the largest logit difference where both are still going alike."""
    unmerged, u_logits = _with_logits("llmtrain.model.fast_sample", sample_fast, monkeypatch, model, prompts,
                                      copy="off", **kwargs)
    merged, m_logits = _with_logits("llmtrain.model.fast_sample", sample_fast, monkeypatch, model, prompts,
                                    copy="rollout", **kwargs)
    same = sum(a == b for a, b in zip(merged, unmerged)) / len(prompts)
    diff = max((m[i] - u[i]).abs().max().item() for t, (m, u) in enumerate(zip(m_logits, u_logits))
               for i in range(len(prompts)) if min(len(merged[i]), len(unmerged[i])) > t
               and merged[i][:t] == unmerged[i][:t])
    return merged, same, diff


def test_a_merged_copy_draws_the_unmerged_adapters_tokens_up_to_rounding_and_leaves_the_weights_alone(
        lora_again, lm, monkeypatch):
    """rl.merged_copy=rollout against off, on a GRPO-sized rollout of an all-linear LoRA (32 prompts x 16, fp32):
    the share of identical completions and the largest logit difference where both are still going alike (x W +
    s (x A) B against x (W + s B A): rounding apart). The trained weights are not touched (never merged in place),
    each adapted linear forwards as before once the rollout ends, and the adapters are in the tokens."""
    from llmtrain.model.merged_copy import adapted_linears

    lora = lora_again
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    prompts = mixed_prompts(32, 16, seed=13)
    seeds = [completion_seed(42, 1, i // 16, i % 16) for i in range(len(prompts))]
    kwargs = dict(seeds=seeds, max_new_tokens=16, temperature=0.5, top_p=1.0, stop_ids={STOP}, pad_id=3)
    merged, same, diff = _merged_against_unmerged(lora, prompts, monkeypatch, **kwargs)
    print(f"merged vs unmerged: {same:.2%} of {len(prompts)} completions identical; logits within {diff:.1e}")
    assert same >= 0.95 and 0 < diff < 1e-4  # not the same code path (0 would say the copy was not used)
    assert all(torch.equal(v, before[k]) for k, v in lora.state_dict().items())
    assert len(adapted_linears(lora)) == 14 and not any("forward" in m.__dict__ for m in adapted_linears(lora))
    base = sample_fast(lm, prompts[:32], **{**kwargs, "seeds": seeds[:32]})
    assert merged[:32] != base  # the adapters are in the merged copy's tokens
    with lora.disable_adapter():  # adapters off: nothing to merge, the base model's tokens
        assert sample_fast(lora, prompts[:32], copy="rollout", **{**kwargs, "seeds": seeds[:32]}) == base


def test_a_dora_policys_merged_copy_is_peft_merge_and_draws_its_unmerged_tokens(tiny_assets, lm, monkeypatch):
    """lora.dora: each adapted linear's copy is (m / n) (W + s B A), peft's merge_and_unload weight to 1e-6 in fp32
    (magnitudes off the base's row norms, B not zero), and a rollout on it draws the unmerged DoRA forward's tokens
    (which computes the row norms in every forward) up to rounding."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.model.merged_copy import adapted_linears, merged_weight

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_dora=True)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    names = {m: n for n, m in model.named_modules()}
    ours = {names[m]: merged_weight(m) for m in adapted_linears(model)}
    assert len(ours) == 7 * len(model.base_model.model.model.layers)
    theirs = dict(copy.deepcopy(model).merge_and_unload().named_modules())
    for name, weight in ours.items():
        assert (weight - theirs[name.removeprefix("base_model.model.")].weight).abs().max().item() < 1e-6, name
    prompts = mixed_prompts(8, 4, seed=21)
    seeds = [completion_seed(42, 1, i // 4, i % 4) for i in range(len(prompts))]
    kwargs = dict(seeds=seeds, max_new_tokens=16, temperature=0.5, top_p=1.0, stop_ids={STOP}, pad_id=3)
    merged, same, diff = _merged_against_unmerged(model, prompts, monkeypatch, **kwargs)
    assert same >= 0.9 and 0 < diff < 1e-4
    assert merged != sample_fast(lm, prompts, **kwargs)  # the adapters are in the copy's tokens


def test_a_kept_copy_is_rewritten_in_place_from_the_current_weights(lora_again):
    """rl.merged_copy=kept: the second rollout reuses the first's buffers (no allocation), rewritten from the
    adapters as they are then: after an update (B changed) it draws what a fresh copy of the new weights draws."""
    from llmtrain.model.merged_copy import KEPT

    lora = lora_again
    prompts = mixed_prompts(4, 4, seed=14)
    kwargs = dict(seeds=list(range(16)), max_new_tokens=12, temperature=1.0, top_p=1.0, stop_ids={STOP}, pad_id=3)
    first = sample_fast(lora, prompts, copy="kept", **kwargs)
    held = getattr(lora, KEPT)
    pointers = {m: w.data_ptr() for m, w in held.items()}
    assert len(held) == 14 and first == sample_fast(lora, prompts, copy="rollout", **kwargs)
    with torch.no_grad():  # an optimizer step's worth of change to every adapter
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)
    second = sample_fast(lora, prompts, copy="kept", **kwargs)
    assert {m: w.data_ptr() for m, w in getattr(lora, KEPT).items()} == pointers  # the same buffers
    assert second == sample_fast(lora, prompts, copy="rollout", **kwargs) and second != first


def test_a_copy_that_does_not_fit_samples_unmerged_with_a_warning(lora_lm, monkeypatch):
    """Where the copy and the KV cache would not fit in the GPU's free memory (merged_copy.fits, played here), the
    rollout builds no copy and samples with the adapters unmerged."""
    monkeypatch.setattr("llmtrain.model.merged_copy.fits", lambda lm, modules, spare_bytes: False)
    monkeypatch.setattr("llmtrain.model.merged_copy.merged_weight", lambda *a, **k: pytest.fail("a copy was built"))
    prompts = mixed_prompts(3, 2, seed=15)
    kwargs = dict(seeds=list(range(6)), max_new_tokens=10, temperature=1.0, top_p=1.0, stop_ids={STOP}, pad_id=3)
    with pytest.warns(UserWarning, match=r"rl.merged_copy=rollout: the merged generation copy \(0.00 GiB\) does not "
                                         "fit beside the KV cache"):
        out = sample_fast(lora_lm, prompts, copy="rollout", **kwargs)
    assert out == sample_fast(lora_lm, prompts, copy="off", **kwargs)


def test_a_16_bit_copy_rounds_small_adapter_changes_away_and_an_fp32_one_keeps_them(tiny_assets):
    """Why rl.merged_copy is off by default: a bf16 copy rounds W + s B A to bf16, and W is on the bf16 grid, so an
    entry whose adapter change is under half a bf16 step of W stays W. With lora_B ~ N(0, 1e-4) (a young adapter) most
    entries of the tiny model's copy are its base's (measured: 71.5%), with N(0, 1e-2) almost none (1.5%); an fp32
    base keeps all but a few."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.model.merged_copy import adapted_linears, merged_weight

    kept = {}
    for dtype, std in ((torch.bfloat16, 1e-4), (torch.bfloat16, 1e-2), (torch.float32, 1e-4)):
        model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=dtype)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=std)
        modules = adapted_linears(model)
        same = [(merged_weight(m) == m.get_base_layer().weight).float().mean().item() for m in modules]
        kept[dtype, std] = sum(same) / len(same)
        assert merged_weight(modules[0]).dtype == dtype
    assert kept[torch.bfloat16, 1e-4] > 0.6 and kept[torch.bfloat16, 1e-2] < 0.05
    assert kept[torch.float32, 1e-4] < 1e-3  # (measured: 0.0024%, where a change is under fp32's step)


@pytest.mark.precision
def test_a_4bit_base_samples_from_a_dequantized_merged_copy(tiny_assets):
    """QLoRA: the copy is the 4-bit base dequantized plus the adapters, in the compute dtype (bf16), as the layer
    computes it. In bf16 the two paths round apart more than in fp32 (the merged weight is rounded to bf16 once), as
    the fast sampler and the reference loop do: measured on 16 prompts x 4 at temperature 1, 58 of 64 completions
    identical (the unmerged fast sampler against the reference loop: 60 of 64)."""
    pytest.importorskip("bitsandbytes")
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.merged_copy import adapted_linears, copy_bytes
    from llmtrain.model.modeling import load_model

    cfg = ModelConfig(name_or_path=str(tiny_assets / "model"), dtype="bfloat16", quantize="nf4",
                      attn_implementation="sdpa")
    qlora = load_model(cfg, LoraConfig(r=4, alpha=8), compute_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in qlora.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    modules = adapted_linears(qlora)
    assert modules and copy_bytes(modules) == sum(2 * m.get_base_layer().in_features
                                                  * m.get_base_layer().out_features for m in modules)
    prompts = mixed_prompts(16, 4, seed=5)
    kwargs = dict(seeds=list(range(64)), max_new_tokens=16, temperature=1.0, top_p=1.0, stop_ids={STOP}, pad_id=3)
    merged = sample_fast(qlora, prompts, copy="rollout", **kwargs)
    unmerged = sample_fast(qlora, prompts, copy="off", **kwargs)
    with qlora.disable_adapter():
        base = sample_fast(qlora, prompts, copy="rollout", **kwargs)
    same = sum(a == b for a, b in zip(merged, unmerged))
    assert same >= 52 and sum(a == b for a, b in zip(merged, base)) < 40  # the adapters are in the copy
