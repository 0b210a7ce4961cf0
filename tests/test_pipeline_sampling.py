"""Sampling through pipeline stages (parallel/pipeline/sampling.py): the stages' KV-cached decoding against one
process's (model/generate.sample on the whole model), its oracle.

In-process: every stage of a 2-stage split held by this process (the hand-offs are then local; the point-to-point
ones are the same tensors), each family's layer (a sliding window shorter than the sequences where it has one, Gemma
3's local and global layers, GPT-OSS's sinks through eager attention, Phi's partial rotary, a tied head, Mixtral's
experts): left-padded prompts of mixed lengths draw the same tokens with the same log-probabilities, and the mask is
checked against transformers' own. Through `accelerate launch`: tests/test_pipeline.py (the eval samples on 2
stages equal one process's)."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_fast_sample import FAMILIES, mixed_prompts

from llmtrain.model.generate import completion_seed, sample
from llmtrain.model.loss import logit_transform
from llmtrain.parallel.pipeline.sampling import StagesLM, decode_mask
from llmtrain.parallel.pipeline.stage import Stage


class _AllStages:
    """What StagesLM reads of a Pipeline, with every stage on this process (no process group needed)."""

    def __init__(self, lm, *cuts: int):
        ends = [0, *cuts, lm.config.num_hidden_layers]
        self.by_stage = {s: Stage(lm, range(a, b), first=s == 0, last=s == len(cuts))
                         for s, (a, b) in enumerate(zip(ends, ends[1:]))}
        self.stage_ranks, self.group = [0] * len(self.by_stage), None
        self.config, self.device = lm.config, lm.device
        self.supports_sdpa = getattr(type(lm), "_supports_sdpa", True)
        self.logits = logit_transform(lm)
        self.vocab = lm.get_output_embeddings().weight.shape[0]


def _model(family: str, **more):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128), **more})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # Gemma's norms start at zero (weight + 1), GPT-OSS's sinks near it: move them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.3)
            if name.endswith(("sinks", "_bias")):
                p.normal_()
    return model


CASES = {**FAMILIES,
         # a local layer on each stage
         "gemma3_text": {**FAMILIES["gemma3_text"],
                         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
         "llama": {}, "mistral": dict(sliding_window=6),
         "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


def _draw(lm, prompts, **kwargs):
    seeds = [completion_seed(7, 3, i // 2, i % 2) for i in range(len(prompts))]
    return sample(lm, prompts, seeds=seeds, stop_ids={2}, pad_id=0, logps=True, max_new_tokens=12, **kwargs)


@pytest.mark.parametrize("family", sorted(CASES))
def test_two_stages_draw_what_the_whole_model_draws_with_its_log_probabilities(family):
    """Gemma 4 (3 layers, the last sharing the second's keys and values) cut after its first layer (its per-layer
    inputs cross the boundary) and after its second (the shared keys and values cross too, the new positions' at
    each step, the receiving stage holding the whole length)."""
    model = _model(family, **CASES[family])
    prompts = mixed_prompts(3, 2, seed=4)
    for cut in (1, 2) if family == "gemma4_text" else (1,):
        for temperature in (0.0, 1.0):
            whole = _draw(model, prompts, temperature=temperature, top_p=1.0)
            staged = _draw(StagesLM(_AllStages(model, cut)), prompts, temperature=temperature, top_p=1.0)
            assert [d.ids for d in staged] == [d.ids for d in whole]
            assert sum(len(d.ids) for d in whole) > 12
            for a, b in zip(staged, whole):
                assert max((abs(x - y) for x, y in zip(a.logps, b.logps)), default=0.0) < 1e-4
    if getattr(model.config, "sliding_window", None):  # the window changes the tokens: it is applied, not ignored
        model.config.sliding_window = 1000
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 1000
        wide = _draw(StagesLM(_AllStages(model, 1)), prompts, temperature=1.0, top_p=1.0)
        assert [d.ids for d in wide] != [d.ids for d in staged]


def test_the_mask_is_transformers_own_on_the_real_positions():
    """Causal over left-padded rows, the padding left out, a window of the last 3 (itself among them); a padding
    query attends to itself alone, so no row of the softmax is empty."""
    from transformers import MistralConfig
    from transformers.masking_utils import create_sliding_window_causal_mask

    attention = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    config = MistralConfig(sliding_window=3, hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    # (the cache is `cache` from transformers 5.2x on, `past_key_values` in 5.17, the GPU machine's)
    cache = "cache" if "cache" in inspect.signature(create_sliding_window_causal_mask).parameters else "past_key_values"
    want = create_sliding_window_causal_mask(config=config, inputs_embeds=torch.zeros(2, 6, 8),
                                             attention_mask=attention, **{cache: None},
                                             position_ids=(attention.cumsum(-1) - 1).clamp(min=0))
    got = decode_mask(attention, 6, 3, boolean=True)
    real = attention.bool()[:, None, :, None].expand(2, 1, 6, 6)
    assert torch.equal(got[real], want[real])
    assert got[~real].sum() == (~attention.bool()).sum()  # each padding query: itself alone
    assert torch.equal(got.sum(-1) > 0, torch.ones(2, 1, 6, dtype=torch.bool))
    # the last query alone (a decoding step): the last row of the full mask
    assert torch.equal(decode_mask(attention, 1, 3, boolean=True), got[:, :, -1:])
    additive = decode_mask(attention, 6, 3, boolean=False)
    assert torch.equal(additive == 0, got) and additive.min() == torch.finfo(torch.float32).min


def test_gemma_4s_sharing_layers_on_two_stages_run_the_last_position_alone_as_transformers_does():
    """Gemma 4 of 4 layers, the last 2 sharing the keys and values of the first 2, on 3 stages (0-1, 2, 3): the
    prompt's pass runs the sharing layers on each row's last position alone (transformers' own shortcut), so the
    third stage receives one position where the step has many, and the store layers' keys and values of every new
    position still travel on to it; the same tokens and log-probabilities as the whole model, and the sharing layers
    saw one position at every step."""
    model = _model("gemma4_text", **{**FAMILIES["gemma4_text"], "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                                     "layer_types": ["sliding_attention", "full_attention"] * 2})
    seen = {i: [] for i in range(4)}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].shape[1]))
    prompts = mixed_prompts(3, 2, seed=4)
    whole = _draw(model, prompts, temperature=1.0, top_p=1.0)
    for i in seen:
        seen[i].clear()
    staged = _draw(StagesLM(_AllStages(model, 2, 3)), prompts, temperature=1.0, top_p=1.0)
    assert [d.ids for d in staged] == [d.ids for d in whole] and sum(len(d.ids) for d in whole) > 12
    for a, b in zip(staged, whole):
        assert max((abs(x - y) for x, y in zip(a.logps, b.logps)), default=0.0) < 1e-4
    assert seen[0][0] > 1 and set(seen[2]) == set(seen[3]) == {1}
