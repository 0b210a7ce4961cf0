"""The estimate's sampling phases (memory/estimate._generation_phases, generation_copy_bytes) against a real rollout
of the fast sampler on the CPU: the live tensor bytes' peak while it prefills and decodes (tests/live_bytes.py, what
torch.cuda.max_memory_allocated counts on a GPU), the weights included, with and without the merged generation copy
(rl.merged_copy). The optimizer's state is left out of both: the rollout here has none."""

from __future__ import annotations

import json

import pytest
import torch
from live_bytes import LiveBytes

from llmtrain.memory.estimate import estimate
from llmtrain.memory.params import _shape_from_json
from llmtrain.memory.spec import TrainSpec
from llmtrain.model.fast_sample import sample_fast

CFG = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
           vocab_size=4096, num_hidden_layers=4)


def sampling_estimate(cfg: dict, dtype: str, copy: str):
    """The estimate of the rollouts below (16 rows, 4 prompts of 32 tokens x 4 completions of 64, LoRA r16), its
    sampling phases and their largest total without the optimizer's state."""
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, dtype=dtype, micro_batch=16, num_generations=4,
                     max_completion_tokens=64, prompt_tokens=32, prompt_longest=32, seq_len=96, merged_copy=copy,
                     attn_implementation="sdpa")
    est = estimate(_shape_from_json(json.dumps(cfg), "tiny"), spec)
    sampling = {name: parts for name, parts in est.phase_parts.items() if name.startswith("generation")}
    return est, sampling, max(sum(parts.values()) - parts.get("optimizer", 0) for parts in sampling.values())


def sampling_peak(shape, spec: TrainSpec) -> int:
    """The estimate's largest sampling phase without the optimizer's state (the rollouts here have none)."""
    parts = estimate(shape, spec).phase_parts
    return max(sum(p.values()) - p.get("optimizer", 0) for name, p in parts.items() if name.startswith("generation"))


def _lora_rollout(dtype: str):
    """The 4-layer Llama of CFG in `dtype` under an all-linear LoRA r16, in eval mode, and the rollout's 16 rows: 4
    prompts of 32 tokens, each 4 times."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"}, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(31)] for i in range(4) for _ in range(4)]
    return model.eval(), prompts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("copy", ["rollout", "off"])
def test_a_rollouts_peak_with_and_without_the_merged_copy_is_the_estimates(copy, dtype):
    """4 prompts of 32 tokens x 4 completions of 64 tokens, an all-linear LoRA r16: within 10% (measured: +1.9%
    with the copy, +2.7% without, fp32), and the copy is the estimate's generation_copy to the byte."""
    from llmtrain.model.merged_copy import adapted_linears, copy_bytes

    model, prompts = _lora_rollout(dtype)
    with LiveBytes() as live:
        live.track(*model.parameters())
        sample_fast(model, prompts, seeds=list(range(16)), max_new_tokens=64, temperature=1.0, top_p=1.0,
                    stop_ids=set(), pad_id=0, copy=copy)
    est, sampling, predicted = sampling_estimate(CFG, dtype, copy)
    print(f"{copy} {dtype}: measured {live.peak:,} B, estimated {predicted:,} B ({predicted / live.peak - 1:+.1%})")
    assert abs(predicted / live.peak - 1) <= 0.10
    copied = sampling["generation"].get("generation_copy", 0)
    assert copied == (copy_bytes(adapted_linears(model)) if copy == "rollout" else 0)
    assert (copied > 0) == (copy == "rollout")
    assert "generation_copy" not in est.phase_parts["forward"]  # freed after the rollout (kept: held throughout)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reference_loops_rollout_is_estimated_as_it_prefills_every_row(dtype):
    """rl.sampler=reference (pipeline stages sample with it): generate.sample prefills every row's whole prompt at once
    through peft's unmerged layers and grows transformers' cache a token at a time, where the fast sampler prefills
    each distinct prompt once into a cache allocated whole. The same rollout as above: within 10% (measured: +1.7% in
    fp32, +2.2% in bf16; priced as the fast sampler's rollout it was -13.7% and -22.7%), the prefill its peak."""
    from llmtrain.model.generate import sample

    model, prompts = _lora_rollout(dtype)
    with LiveBytes() as live:
        live.track(*model.parameters())
        sample(model, prompts, seeds=list(range(16)), max_new_tokens=64, temperature=1.0, top_p=1.0, stop_ids=set(),
               pad_id=0)
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, dtype=dtype, micro_batch=16, num_generations=4,
                     max_completion_tokens=64, prompt_tokens=32, prompt_longest=32, seq_len=96,
                     attn_implementation="sdpa", reference_sampler=True)
    est = estimate(_shape_from_json(json.dumps(CFG), "tiny"), spec)
    phases = {name: sum(parts.values()) - parts.get("optimizer", 0) for name, parts in est.phase_parts.items()
              if name.startswith("generation")}
    predicted = max(phases.values())
    print(f"reference {dtype}: measured {live.peak:,} B, estimated {predicted:,} B ({predicted / live.peak - 1:+.1%})")
    assert abs(predicted / live.peak - 1) <= 0.10
    assert max(phases, key=phases.get) == "generation_prefill"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filters", [{}, {"repetition_penalty": 1.3}, {"top_p": 0.9}, {"top_k": 50}, {"min_p": 0.05},
                                     {"top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 0.8}])
def test_a_decode_steps_sampler_holds_what_the_estimate_prices_for_its_filters(dtype, filters):
    """act.sampler_bytes against next_tokens' live bytes (the logits and the seen flags counted as the estimate
    counts them, beside what the sampler makes): to the byte but for the uniforms, tokens and top_k's values (under
    0.1%). Before, every decode step was priced at a flat 16 bytes a row and vocabulary entry: a top_p run's held
    2.1 times that (fp32 logits), 2.4 times with every filter and the penalty."""
    from llmtrain.memory.activations import sampler_bytes
    from llmtrain.model.generate import next_tokens, seen_tokens

    rows, vocab = 16, 4096
    torch.manual_seed(0)
    settings = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **filters}
    with LiveBytes() as live:
        logits = (torch.randn(rows, vocab) * 3).to(dtype)  # the head's, in the model's dtype
        seen = seen_tokens([[1, 2, 3]] * rows, vocab, "cpu") if settings["repetition_penalty"] != 1.0 else None
        next_tokens(logits, torch.rand(rows), seen=seen, **settings)
    predicted = sampler_bytes(rows, vocab, logits.element_size(), **settings)
    assert predicted <= live.peak <= predicted * 1.001, (live.peak, predicted)


def test_a_long_prompt_prefilled_in_chunks_holds_less_and_the_estimate_follows_the_chunk(monkeypatch):
    """4 prompts of 512 tokens x 2 completions of 8 (fp32, no LoRA), prefilled 64 positions at a time against 1,024
    (the whole width at once): the measured peak drops (33.5 against 48.5 MB: a chunk's layer transients, not the
    whole width's), and so does the estimate's prefill phase (31.4 against 53.9 MB; the CPU's SDPA keeps the
    width's scores, which the estimate, made for a GPU's attention, does not count, hence the gap)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"}, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(511)] for i in range(4) for _ in range(2)]
    spec = TrainSpec(micro_batch=8, num_generations=2, max_completion_tokens=8, prompt_tokens=512,
                     prompt_longest=512, seq_len=520, attn_implementation="sdpa")
    measured, predicted = {}, {}
    for chunk in (64, 1024):
        monkeypatch.setattr("llmtrain.model.fast_sample.PREFILL_CHUNK", chunk)
        monkeypatch.setattr("llmtrain.memory.estimate.PREFILL_CHUNK", chunk)
        with LiveBytes() as live:
            live.track(*model.parameters())
            out = sample_fast(model, prompts, seeds=list(range(8)), max_new_tokens=8, temperature=1.0, top_p=1.0,
                              stop_ids=set(), pad_id=0)
        measured[chunk] = live.peak
        prefill = estimate(_shape_from_json(json.dumps(CFG), "tiny"), spec).phase_parts["generation_prefill"]
        predicted[chunk] = sum(prefill.values()) - prefill.get("optimizer", 0)
        if chunk == 64:
            chunked = out
    print(f"measured {measured}, estimated {predicted}")
    assert measured[64] < 0.8 * measured[1024] and predicted[64] < 0.8 * predicted[1024]
    assert out == chunked  # the same completions either way


def test_a_mixture_of_experts_rollout_merges_none_of_its_experts():
    """A tiny Qwen3-MoE (8 experts of 128 columns, 2 a token) under an all-linear LoRA r16 (bf16, the merged copy on):
    the copy holds attention's linears only (peft adapts the router and the experts as parameters), and the experts
    run their adapters beside them (model/lora_experts.py: peft would merge a layer's experts at every forward, 8 x 3
    x 128 x 256 x 2 bytes, and the peak would hold them); the rollout's peak within 10% of the estimate's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model import lora_experts
    from llmtrain.model.merged_copy import adapted_linears, copy_bytes

    cfg = dict(CFG, model_type="qwen3_moe", head_dim=32, moe_intermediate_size=128, num_experts=8,
               num_experts_per_tok=2)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**cfg, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    assert lora_experts.install(model) == 4  # one a layer, as model/modeling.apply_lora does
    model.eval()
    assert {m.get_base_layer().__class__.__name__ for m in adapted_linears(model)} == {"Linear"}
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(31)] for i in range(4) for _ in range(4)]
    with LiveBytes() as live:
        live.track(*model.parameters())
        sample_fast(model, prompts, seeds=list(range(16)), max_new_tokens=64, temperature=1.0, top_p=1.0,
                    stop_ids=set(), pad_id=0, copy="rollout")
    _, sampling, predicted = sampling_estimate(cfg, "bfloat16", "rollout")
    print(f"moe: measured {live.peak:,} B, estimated {predicted:,} B ({predicted / live.peak - 1:+.1%})")
    assert abs(predicted / live.peak - 1) <= 0.10
    assert sampling["generation"]["generation_copy"] == copy_bytes(adapted_linears(model))
    assert "temporaries" not in sampling["generation"]


def test_a_gpt_oss_rollout_holds_its_scores_over_the_cache_as_the_estimate_says():
    """A tiny GPT-OSS (8 heads, 8 experts of 128, 2 a token; bf16) under LoRA r16 on attention and on its experts
    (lora.target_parameters): 4 prompts of 256 tokens x 4 completions of 32. Its attention over the cache puts each
    head's sink in the softmax (model/fast_sample._with_sinks), which holds the scores of a prefill chunk over the
    prompts' width in fp32 (act.sink_sampling_bytes): the rollout's peak within 10% of the estimate's, which without
    that term is more than 10% under it."""
    from dataclasses import replace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model import lora_experts

    cfg = dict(CFG, model_type="gpt_oss", head_dim=32, intermediate_size=128, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=64)
    parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg, attn_implementation="eager"))
    model = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                                lora_dropout=0.0, target_parameters=parameters))
    assert lora_experts.install(model) == 4
    model.eval()
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(255)] for i in range(4) for _ in range(4)]
    with LiveBytes() as live:
        live.track(*model.parameters())
        sample_fast(model, prompts, seeds=list(range(16)), max_new_tokens=32, temperature=1.0, top_p=1.0,
                    stop_ids=set(), pad_id=0, copy="rollout")
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, dtype="bfloat16", micro_batch=16, num_generations=4,
                     max_completion_tokens=32, prompt_tokens=256, prompt_longest=256, seq_len=288,
                     merged_copy="rollout", attn_implementation="auto", lora_target_parameters=tuple(parameters))
    shape = _shape_from_json(json.dumps(cfg), "tiny")
    predicted, without = sampling_peak(shape, spec), sampling_peak(replace(shape, sinks=False), spec)
    print(f"gpt_oss: measured {live.peak:,} B, estimated {predicted:,} B ({predicted / live.peak - 1:+.1%}), "
          f"without the scores {without:,} B")
    assert abs(predicted / live.peak - 1) <= 0.10 and without < 0.9 * live.peak


def test_a_gemma_4_rollout_holds_each_layers_own_cache_as_the_estimate_says():
    """A tiny Gemma 4 as its checkpoints are (local layers with heads of 32 and 4 K/V heads, global ones of 64 with
    2, the last two layers sharing the keys and values of the two before them, their MLPs double-wide, per-layer
    inputs; bf16) under LoRA r16, the merged copy on: 4 prompts of 128 tokens x 4 completions of 64. The static cache
    holds each layer's own heads and none for a layer that shares (model/fast_sample.py; estimate.kv_cache_bytes:
    half what four layers like the first would hold), the copy each adapted linear of every layer's own shape (the
    double-wide MLPs' too), and the rollout's peak is within 10% of the estimate's (measured 27,178,508 B, estimated
    +8.2%: the peak is the static cache's build after the prefill, the distinct prompts' small cache beside it and one
    layer's prefix copy, where the estimate counts the static cache beside the prefill's layer transients; the
    sharing layers run on each row's last position, estimated so, which took 1.8 MB off both)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.memory.estimate import kv_cache_bytes
    from llmtrain.model.merged_copy import adapted_linears, copy_bytes

    cfg = dict(CFG, model_type="gemma4_text", head_dim=32, global_head_dim=64, num_key_value_heads=4,
               num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
               sliding_window=64, vocab_size_per_layer_input=4096, hidden_size_per_layer_input=64,
               layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg, attn_implementation="sdpa"))
    model = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                                lora_dropout=0.0))
    model.eval()
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(127)] for i in range(4) for _ in range(4)]
    with LiveBytes() as live:
        live.track(*model.parameters(), *model.buffers())
        sample_fast(model, prompts, seeds=list(range(16)), max_new_tokens=64, temperature=1.0, top_p=1.0,
                    stop_ids=set(), pad_id=0, copy="rollout")
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, dtype="bfloat16", micro_batch=16, num_generations=4,
                     max_completion_tokens=64, prompt_tokens=128, prompt_longest=128, seq_len=192,
                     merged_copy="rollout", attn_implementation="sdpa")
    shape = _shape_from_json(json.dumps(cfg), "tiny")
    parts = {n: p for n, p in estimate(shape, spec).phase_parts.items() if n.startswith("generation")}
    predicted = max(sum(p.values()) - p.get("optimizer", 0) for p in parts.values())
    print(f"gemma4: measured {live.peak:,} B, estimated {predicted:,} B ({predicted / live.peak - 1:+.1%})")
    assert abs(predicted / live.peak - 1) <= 0.10
    # 16 rows x 192 positions, K and V of the two layers that store them (4 x 32 and 2 x 64), bf16
    assert parts["generation"]["kv_cache"] == kv_cache_bytes(shape, spec) == 16 * 192 * 2 * (4 * 32 + 2 * 64) * 2
    assert parts["generation"]["generation_copy"] == copy_bytes(adapted_linears(model))


def test_a_reward_model_is_on_every_phase_and_its_scoring_peak_is_the_estimates(tmp_path):
    """rl.rewards of type reward_model: a frozen sequence-classification model every process holds whole, scoring the
    completions after each rollout in batches of its batch_size (objectives/learned_reward). The estimate had left it
    out (a 7B reward model beside recipes/llama3-8b-grpo.yaml: 47.2 GiB estimated, 13.25 GiB of reward model not
    counted). Here: its weights are counted to the byte from its folder, in every phase, and the rollout then the
    scoring of its 16 completions (8 at a time) peak within 10% of the sampling and scoring phases."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from llmtrain.memory.params import reward_models_of
    from llmtrain.memory.reward_models import weight_bytes

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"}, attn_implementation="sdpa")
    policy = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                                 lora_dropout=0.0)).eval()
    labels = {k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}
    reward = LlamaForSequenceClassification(LlamaConfig(**{**labels, "pad_token_id": 0}, num_labels=1)).eval()
    reward.save_pretrained(tmp_path / "rm")
    recipe = SimpleNamespace(rl=SimpleNamespace(rewards=[
        SimpleNamespace(type="answer_match", path=None),
        SimpleNamespace(type="reward_model", path=str(tmp_path / "rm"), batch_size=8)]))
    (found,) = reward_models_of(recipe)
    assert weight_bytes(found) == sum(p.numel() * p.element_size() for p in reward.parameters())
    prompts = [[1] + [5 + (i * 7 + j) % 4000 for j in range(31)] for i in range(4) for _ in range(4)]
    with LiveBytes() as live:
        live.track(*policy.parameters(), *reward.parameters())
        completions = sample_fast(policy, prompts, seeds=list(range(16)), max_new_tokens=64, temperature=1.0,
                                  top_p=1.0, stop_ids=set(), pad_id=0, copy="off")
        sampled, live.peak = live.peak, live.now
        sequences = [p + c for p, c in zip(prompts, completions)]
        with torch.no_grad():  # as learned_reward scores: right-padded batches of batch_size, with their mask
            for s in range(0, len(sequences), found.batch_size):
                batch = sequences[s:s + found.batch_size]
                width = max(map(len, batch))
                reward(input_ids=torch.tensor([x + [0] * (width - len(x)) for x in batch]),
                       attention_mask=torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch]))
        scored = live.peak
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, dtype="float32", micro_batch=16, num_generations=4,
                     max_completion_tokens=64, prompt_tokens=32, prompt_longest=32, seq_len=96, merged_copy="off",
                     attn_implementation="sdpa", reward_models=(found,))
    est = estimate(_shape_from_json(json.dumps(CFG), "tiny"), spec)
    assert all(parts["reward_models"] == weight_bytes(found) for parts in est.phase_parts.values())

    def total(name: str) -> int:
        return sum(est.phase_parts[name].values()) - est.phase_parts[name].get("optimizer", 0)

    sampling, scoring = max(total("generation_prefill"), total("generation")), total("reward_scoring")
    print(f"sampling: measured {sampled:,} B, estimated {sampling:,} B ({sampling / sampled - 1:+.1%}); scoring: "
          f"measured {scored:,} B, estimated {scoring:,} B ({scoring / scored - 1:+.1%})")
    assert abs(sampling / sampled - 1) <= 0.10 and abs(scoring / scored - 1) <= 0.10


def test_a_lora_reward_adapters_base_is_found_from_where_its_run_started(tmp_path, monkeypatch):
    """A reward model trained with LoRA on `model.name_or_path=base` (relative) in one directory, used by an RL run
    started in another: its adapter names the base as given, which is read from where the reward run was started
    (its recipe.yaml's first line), for loading it (model/score.load_reward_model) and for the estimate: the base's
    weights in its saved dtype, under the score head, and the adapter's file."""
    from types import SimpleNamespace

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.config import WRITTEN_FROM, adapter_base
    from llmtrain.memory.params import load_model_shape, reward_models_of, score_head_shape
    from llmtrain.memory.reward_models import weight_bytes

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"})).save_pretrained(
        work / "base")
    final = work / "runs" / "rm" / "final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base", "task_type": "SEQ_CLS"}))
    save_file({"score.weight": torch.zeros(1, 256)}, final / "adapter_model.safetensors")
    (final.parent / "recipe.yaml").write_text(f"# {WRITTEN_FROM}{work}\noutput_dir: runs/rm\n")
    monkeypatch.chdir(elsewhere)
    assert adapter_base(final) == str(work / "base")
    recipe = SimpleNamespace(rl=SimpleNamespace(rewards=[SimpleNamespace(type="reward_model", path=str(final),
                                                                         batch_size=4)]))
    (found,) = reward_models_of(recipe)
    shape = score_head_shape(load_model_shape(str(work / "base")))
    assert found.dtype == "float32" and found.adapter_bytes == (final / "adapter_model.safetensors").stat().st_size
    assert weight_bytes(found) == shape.params_total * 4 + found.adapter_bytes
    monkeypatch.chdir(work)  # from where it was started the base is found as given
    assert adapter_base(final) == "base"


def test_a_tool_rounds_rollout_prefills_every_row_and_the_estimate_bounds_it():
    """With rl.tools, once the tools' results are in, every live row is sampled again from its own prompt + completion
    so far (tool_calls.sample_with_tools): a prefill per row, not per prompt, and a cache as wide as the longest such
    prefix and the most room left. The estimate had priced the first round alone, 42% under this one (audit 35); it
    prices the widest such round now (TrainSpec.tool_rounds: the longest prompt + 2 x max_completion_tokens)."""
    from dataclasses import replace

    model, prompts = _lora_rollout("float32")
    so_far = [56] + [8] * 15  # one row called late, the others early (the tools' results counted in)
    later = [p + [7 + (i * 13 + j) % 4000 for j in range(n)] for i, (p, n) in enumerate(zip(prompts, so_far))]
    with LiveBytes() as live:
        live.track(*model.parameters())
        sample_fast(model, later, seeds=list(range(16)), max_new_tokens=64 - min(so_far), temperature=1.0, top_p=1.0,
                    stop_ids=set(), pad_id=0, copy="off")
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, dtype="float32", micro_batch=16, num_generations=4,
                     max_completion_tokens=64, prompt_tokens=32, prompt_longest=32, seq_len=96, merged_copy="off",
                     attn_implementation="sdpa", tool_rounds=True)
    shape = _shape_from_json(json.dumps(CFG), "tiny")
    predicted, first_round = sampling_peak(shape, spec), sampling_peak(shape, replace(spec, tool_rounds=False))
    print(f"measured {live.peak:,} B, estimated {predicted:,} B ({predicted / live.peak - 1:+.1%}), the first "
          f"round's {first_round:,} B ({first_round / live.peak - 1:+.1%})")
    assert live.peak <= predicted <= 1.2 * live.peak  # a bound: this round's prefixes are short of the widest
    assert first_round < 0.75 * live.peak


def test_a_tools_recipe_is_priced_with_tool_rounds_and_its_sequence_groups_first_gpu_sampling_every_row():
    """spec_from_recipe reads rl.tools (and rl.environment) into TrainSpec.tool_rounds; under sequence parallelism
    the group's first GPU samples every row with tools (shards.on_first_of_group), where each GPU draws 1/N without:
    said in a note and left out of the figure (27% low on an 8B recipe; audit 35)."""
    from dataclasses import replace

    from conftest import REPO

    from llmtrain.config import load_recipe
    from llmtrain.memory.estimate import sampling_rows
    from llmtrain.memory.spec import spec_from_recipe

    assert spec_from_recipe(load_recipe(REPO / "recipes" / "tiny-tools-grpo.yaml")).tool_rounds
    assert not spec_from_recipe(load_recipe(REPO / "recipes" / "tiny-grpo.yaml")).tool_rounds
    spec = TrainSpec(method="lora", micro_batch=16, num_generations=4, max_completion_tokens=64, prompt_tokens=32,
                     seq_len=96, sequence_parallel=2)
    assert sampling_rows(spec) == 8 and sampling_rows(replace(spec, tool_rounds=True)) == 16
