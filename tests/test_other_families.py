"""Models outside the capability table's families: what llmtrain's attention and packed rows do not compute of a model
is refused before the run (capabilities.attention_problems), the settings each refusal gives train the model as
transformers computes it, each example alone, and the loss reads the logits the model's own forward makes.

- Llama 4 (chunked attention), Qwen3.5 (Gated DeltaNet layers, linear_attention) and a Gemma 2 config that caps its
  attention scores on the varlen attention, and GPT-OSS packed under transformers' eager attention (its masks do not
  see a packed row): a packed row's loss differs from each example alone (the refusal is needed: 9.1e-4 to 5.3e-3
  relative, or transformers' own error), and the advised setting equals it to 1e-6 (GPT-OSS: the varlen attention,
  which computes its sinks).
- The rules from configs alone: each refused with its setting, each advised setting passes, the table's families
  pass; flash-linear-attention installed lets Qwen3.5 pack.
- `llmtrain finetune` on a tiny GPT-OSS: eager and packed, exit 2, one paragraph naming the sinks, no run folder; on
  the varlen attention, packed, it trains. The varlen attention itself refuses score caps handed to it, and sinks for
  other heads than its own (the net under the rules).
- The logits: a scale (Granite, Cohere 2, Falcon-H1) or a cap (Gemma 2) the model's forward applies to its head's
  output is applied by the chunked loss and a distillation teacher's logits; anything else is refused.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, cli, records, run_train, tiny_gpt_oss, tiny_gpt_oss_mxfp4, write_recipe

from llmtrain import capabilities
from llmtrain.data.batching import collate, with_loss_positions
from llmtrain.errors import LLMTrainError
from llmtrain.model.attention import register, varlen_attention_forward
from llmtrain.model.loss import attach_loss, compute_loss
from llmtrain.parallel.pipeline.stage import kv_sharing

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              vocab_size=97, attention_dropout=0.0, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
OTHER = {
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(num_local_experts=4, attention_chunk_size=4),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "gemma2": dict(final_logit_softcapping=None, attn_logit_softcapping=0.5, query_pre_attn_scalar=16,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    # per-layer inputs, a local layer, two global ones of their own head size, the last reusing the keys and values of
    # the one before it (kv sharing), the logits capped
    "gemma4_text": dict(global_head_dim=32, sliding_window=4, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=97, num_kv_shared_layers=1, final_logit_softcapping=1.0,
                        layer_types=["sliding_attention", "full_attention", "full_attention"]),
}
LENGTHS = [5, 9, 3, 12, 1]


def config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, "num_hidden_layers": len(OTHER[model_type].get(
        "layer_types", "ab")), **OTHER[model_type]})


def model(model_type: str, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    out = AutoModelForCausalLM.from_config(config(model_type), dtype=torch.float32, attn_implementation=attn)
    if model_type == "gemma2":  # scores above the cap (a random init's are about 1e-3)
        with torch.no_grad():
            for name, p in out.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(20)
    return out


def examples() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 97, (n,), generator=g).tolist(),
             "labels": torch.randint(3, 97, (n,), generator=g).tolist()} for n in LENGTHS]


def alone(model_type: str) -> float:
    """The summed loss of each example run alone through transformers' eager attention."""
    ref, exs = model(model_type, "eager"), examples()
    logits = torch.cat([ref(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0] for e in exs])
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()


def batch_loss(model_type: str, attn: str, *, packing: bool) -> float:
    m = model(model_type, attn)
    attach_loss(m, chunk=7)
    return compute_loss(m, with_loss_positions(collate(examples(), pad_id=0, packing=packing))).item()


# (model_type, what the rules refuse: attention, packing; why; the setting they give: attention, packing). "auto" is
# llmtrain's varlen attention.
CASES = [("gpt_oss", ("eager", True), "masks", ("auto", True)),
         # packed under SDPA where transformers' chunked mask counts each example's chunks (5.25), else padded rows
         ("llama4_text", ("auto", True), "chunks", ("sdpa", capabilities.chunks_each_example())),
         ("gemma2", ("auto", True), "score caps", ("eager", True)),
         ("qwen3_5_text", ("auto", True), "linear_attention", ("sdpa", False))]


@pytest.mark.parametrize(("model_type", "refused", "why", "advised"), CASES, ids=[c[0] for c in CASES])
def test_what_a_refused_setting_would_get_wrong_and_the_advised_setting_gets_right(monkeypatch, model_type, refused,
                                                                                   why, advised):
    from llmtrain.model import attention

    def impl(attn: str) -> str:
        return register() if attn == "auto" else attn

    want = alone(model_type)
    if why == "score caps":  # handed to the varlen attention: it refuses them itself, at the first call
        with pytest.raises(LLMTrainError, match="does not compute"):
            batch_loss(model_type, register(), packing=True)
        monkeypatch.setattr(attention, "UNCOMPUTED", {})  # what it would compute without that refusal
    try:
        got = batch_loss(model_type, impl(refused[0]), packing=refused[1])
    except ValueError as e:  # Qwen3.5: transformers 5.25's torch fallback refuses packed rows at the first step
        assert why == "linear_attention" and "flash-linear-attention" in str(e)
    else:
        # measured: GPT-OSS 9.1e-4 (eager: its masks let a packed row's examples see each other), Llama 4 5.0e-3
        # (chunks of 4), Gemma 2 5.3e-3 (scores capped at 0.5), Qwen3.5 1.3e-4 (transformers 5.17's torch path of
        # the Gated DeltaNet carries its state over a packed row's examples; 5.25's raises)
        assert abs(got - want) / want > 5e-5, (model_type, got, want)
    assert batch_loss(model_type, impl(advised[0]), packing=advised[1]) == pytest.approx(want, rel=1e-6)


def recipe(attn: str = "auto", packing: bool = False, budget: int | None = None):
    from llmtrain.config import ModelConfig

    return SimpleNamespace(model=ModelConfig(name_or_path="unused", attn_implementation=attn),
                           data=SimpleNamespace(packing=packing), train=SimpleNamespace(micro_batch_tokens=budget))


def test_the_rules_refuse_each_from_its_config_and_pass_the_setting_they_give():
    none = {"installed": lambda module: False}
    q35, l4, g2 = (config(t) for t in ("qwen3_5_text", "llama4_text", "gemma2"))
    [p] = capabilities.attention_problems(recipe(), q35, **none)
    assert p.startswith("qwen3_5_text has linear_attention layers") and p.endswith(
        "install it, or train each example as a padded row of its own: model.attn_implementation=sdpa"), p
    [p] = capabilities.attention_problems(recipe("sdpa", packing=True), q35, **none)
    assert p.endswith("data.packing=false"), p
    assert capabilities.attention_problems(recipe("sdpa"), q35, **none) == []
    # with flash-linear-attention, transformers keeps packed examples apart in those layers itself
    assert capabilities.attention_problems(recipe(packing=True), q35, installed=lambda module: module == "fla") == []
    [p] = capabilities.attention_problems(recipe("varlen", packing=True), l4, packed_chunks=True)
    assert "attends within chunks of 4 tokens" in p and p.endswith("set model.attn_implementation=sdpa (transformers' "
                                                                     "chunked mask, which keeps a packed row's "
                                                                     "examples apart too)"), p
    assert capabilities.attention_problems(recipe("sdpa", packing=True), l4, packed_chunks=True) == []
    # a transformers whose chunked mask counts chunks from a packed row's start (5.17): packing refused, either way
    [p] = capabilities.attention_problems(recipe("sdpa", packing=True), l4, packed_chunks=False)
    assert p.startswith("data.packing with model.attn_implementation=sdpa: llama4_text attends within chunks of 4") \
        and p.endswith("set data.packing=false, or install transformers 5.25 or later"), p
    [p] = capabilities.attention_problems(recipe("varlen", packing=True), l4, packed_chunks=False)
    assert p.endswith("set model.attn_implementation=sdpa and data.packing=false (this transformers' chunked mask "
                      "counts the chunks from the start of a packed row, not of each example (transformers 5.25 and "
                      "later count them from each example's start))"), p
    for attn in ("sdpa", "eager"):
        assert capabilities.attention_problems(recipe(attn), l4, packed_chunks=False) == []
    [p] = capabilities.attention_problems(recipe(), g2)
    assert "attn_logit_softcapping=0.5" in p and p.endswith("set model.attn_implementation=eager"), p
    assert capabilities.attention_problems(recipe("eager", packing=True), g2) == []
    oss = config("gpt_oss")
    [p] = capabilities.attention_problems(recipe("eager", packing=True), oss, sinks=True)
    assert p.startswith("data.packing with model.attn_implementation=eager: gpt_oss's attention has sinks") and \
        p.endswith("set model.attn_implementation=auto (llmtrain's varlen attention computes the sinks, each example "
                   "on its own), or data.packing=false"), p
    assert capabilities.attention_problems(recipe("eager"), oss, sinks=True) == []
    assert capabilities.attention_problems(recipe(packing=True), oss, sinks=True) == []  # the varlen attention's
    # a token budget packs every micro-batch whatever data.packing says: GPT-OSS's eager run had trained on packed
    # rows whose examples saw each other (step 1's loss 4.6465 against the varlen attention's 4.6443; audit 58)
    [p] = capabilities.attention_problems(recipe("eager", budget=512), oss, sinks=True)
    assert p.startswith("train.micro_batch_tokens=512 (a token budget packs every micro-batch) with "
                        "model.attn_implementation=eager: gpt_oss's attention has sinks") and p.endswith(
        "or train.micro_batch_tokens=null (micro-batches of train.micro_batch_size rows)"), p
    [p] = capabilities.attention_problems(recipe("sdpa", budget=512), q35, **none)
    assert "keeps the examples of a packed row (train.micro_batch_tokens=512 (a token budget" in p, p
    [p] = capabilities.attention_problems(recipe("sdpa", budget=512), l4, packed_chunks=False)
    assert p.endswith("set train.micro_batch_tokens=null (micro-batches of train.micro_batch_size rows), or install "
                      "transformers 5.25 or later"), p


def test_an_attention_kernel_transformers_lacks_for_the_model_is_refused_before_the_run_and_the_estimate():
    """GPT-OSS under model.attn_implementation=sdpa: transformers refuses to load it (_supports_sdpa False), once the
    data had been tokenised, with the hub's advice; doctor passed it and the estimate priced an sdpa run."""
    from helpers import estimate_memory

    oss = config("gpt_oss")
    [p] = capabilities.attention_problems(recipe("sdpa"), oss)
    assert p == ("model.attn_implementation=sdpa: transformers has no sdpa attention for gpt_oss (GptOssForCausalLM "
                 "sets _supports_sdpa False: its sinks), and refuses to load it so: set model.attn_implementation=auto "
                 "(llmtrain's varlen attention) or eager"), p
    for attn in ("auto", "eager", "flash_attention_2"):  # (flash: transformers' kernels hub computes its sinks)
        assert capabilities.attention_problems(recipe(attn), oss) == []
    assert capabilities.attention_problems(recipe("sdpa"), config("llama4_text"), packed_chunks=True) == []
    out = estimate_memory("recipes/gpt-oss-20b-lora.yaml", "model.attn_implementation=sdpa", check=False)
    assert out.returncode == 2 and "would be refused on 1 GPU (single), so there is no run to estimate: " \
        "model.attn_implementation=sdpa: transformers has no sdpa attention for gpt_oss" in out.stderr, out.stderr
    assert estimate_memory("recipes/gpt-oss-20b-lora.yaml", "model.attn_implementation=eager").returncode == 0


def test_the_installed_transformers_chunked_mask_is_told_apart():
    """chunks_each_example says what this transformers' chunked mask does: Llama 4's packed rows under SDPA equal each
    example alone where it says so (5.25), and train on the row's chunks where not (5.17: 2.0e-3 relative off)."""
    want, got = alone("llama4_text"), batch_loss("llama4_text", "sdpa", packing=True)
    assert (abs(got - want) / want < 1e-6) == capabilities.chunks_each_example(), (got, want)


@pytest.mark.parametrize("model_type", sorted(capabilities.FAMILIES))
def test_the_tables_families_pass_every_attention_rule(model_type):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)  # the family's defaults: Gemma 3's window layers, the experts
    assert capabilities.attention_problems(recipe(packing=True), cfg, installed=lambda module: False) == []


@pytest.mark.parametrize("moe", [False, True])
def test_gemma_4s_shared_keys_and_values_train_packed_as_each_example_alone(monkeypatch, moe):
    """Gemma 4's last layers reuse an earlier layer's keys and values (kv sharing): packed rows on the varlen
    attention, and padded rows under SDPA, give each example's loss alone through transformers' eager attention; so
    does its mixture-of-experts variant (4 experts, 2 a token, beside its dense MLP)."""
    if moe:
        monkeypatch.setitem(OTHER, "gemma4_text", {**OTHER["gemma4_text"], "enable_moe_block": True, "num_experts": 4,
                                                   "top_k_experts": 2, "moe_intermediate_size": 32})
    assert kv_sharing(config("gemma4_text")) == ["store", "store", "reuse"]
    assert capabilities.experts(config("gemma4_text")) == (4 if moe else 0)
    want = alone("gemma4_text")
    for attn, packing in [(register(), True), ("sdpa", False)]:
        got = batch_loss("gemma4_text", attn, packing=packing)
        assert abs(got - want) / want < 1e-6, (attn, got, want)


def test_sinks_are_found_on_the_loaded_model():
    assert "sinks" in capabilities.loaded_model_problems(recipe("eager", packing=True), model("gpt_oss", "eager"))[0]
    assert capabilities.loaded_model_problems(recipe(packing=True), model("gpt_oss", "eager")) == []
    assert capabilities.loaded_model_problems(recipe("eager", packing=True), model("llama4_text", "sdpa")) == []


def test_gpt_oss_sinks_are_known_from_its_config_before_the_load():
    """doctor and launch had passed GPT-OSS packed under eager attention (its sinks known only on the loaded model),
    which finetune then refused (audit 53): the config's model_type says it."""
    from llmtrain.config import load_recipe
    from llmtrain.layout import Layout

    def problems(*overrides: str) -> list[str]:
        return capabilities.model_problems(load_recipe(REPO / "recipes" / "tiny.yaml", list(overrides)), Layout(),
                                           config("gpt_oss"))

    assert any("gpt_oss's attention has sinks" in p for p in problems("model.attn_implementation=eager",
                                                                       "data.packing=true"))
    assert not any("sinks" in p for p in problems() + problems("model.attn_implementation=eager"))


def test_the_varlen_attention_refuses_what_it_does_not_compute():
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 2, 6, 16)
    out, _ = varlen_attention_forward(torch.nn.Identity(), q, k, v, None, sliding_window=None, use_cache=False)
    assert out.shape == (1, 6, 4, 16)
    with pytest.raises(LLMTrainError, match="passes softcap \\(a cap on the attention scores\\).*does not compute"):
        varlen_attention_forward(torch.nn.Identity(), q, k, v, None, softcap=50.0)
    # sinks for other heads than this process's (split over a sequence group): refused, not misapplied
    with pytest.raises(LLMTrainError, match="hands its attention 8 sinks for 4 query heads"):
        varlen_attention_forward(torch.nn.Identity(), q, k, v, None, s_aux=torch.zeros(8))


@pytest.mark.slow
def test_finetune_trains_a_model_with_sinks_packed_and_refuses_its_eager_packing(tiny_assets, tmp_path):
    folder = tiny_gpt_oss(tiny_assets, tmp_path / "gpt-oss", window=8)
    path = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(folder), "attn_implementation": "eager"},
                        data={"packing": True}, train={"max_steps": 12, "lr": 3e-3, "micro_batch_size": 8})
    out = tmp_path / "run"
    refused = cli("finetune", str(path), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    [line] = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert "gpt_oss's attention has sinks" in line and line.endswith("or data.packing=false."), line
    assert not out.exists()
    cli("finetune", str(path), "model.attn_implementation=auto")  # packed rows, the sinks in the varlen attention
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    first, last = (sum(r["loss"] for r in part) / 3 for part in (lines[:3], lines[-3:]))
    assert len(lines) == 12 and last < 0.9 * first, (first, last)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama4_text"])
def test_doctor_refuses_from_the_config_what_finetune_would(tmp_path, model_type):
    """`llmtrain doctor`'s layout row asks the same rules of the model's config (finetune asks them before it writes
    anything, `llmtrain launch` before any process starts); the advised setting passes."""
    from llmtrain.config import load_recipe
    from llmtrain.doctor import check_layout

    import importlib.util

    if model_type == "qwen3_5_text" and importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed here: Qwen3.5 packs")
    config(model_type).save_pretrained(tmp_path / model_type)
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [f"model.name_or_path={tmp_path / model_type}"])
    [(name, status, detail)] = check_layout(recipe, {})
    assert (name, status) == ("layout", "fail") and detail.startswith(
        {"qwen3_5_text": "qwen3_5_text has linear_attention layers", "llama4_text": "model.attn_implementation=auto "
         "(llmtrain's varlen attention) lets each token see its whole example"}[model_type]), detail
    fixed = load_recipe(REPO / "recipes" / "tiny.yaml", [f"model.name_or_path={tmp_path / model_type}",
                                                         "model.attn_implementation=sdpa"])
    assert check_layout(fixed, {})[0][:2] == ("layout", "pass")


# --------------------------------------------------------------------------- the logits the loss reads

# Models whose own forward scales or caps their LM head's logits (config values of their released checkpoints' kind;
# Gemma 2's cap lowered from 30 so that it bends a random model's logits), and one whose decoder is not `model`: the
# loss was 3.1e-4 (Granite), 3.2e-3 (Cohere 2) and 1.9e-3 (Falcon-H1) off the model's own before llmtrain applied the
# scale; Gemma 2 (and any final_logit_softcapping) was refused; GPT-NeoX's ended in an AttributeError.
SCALED = {"granite": (dict(logits_scaling=8.0), dict(scale=1 / 8)),
          "cohere2": (dict(logit_scale=0.0625, sliding_window=4), dict(scale=0.0625)),
          # its Mamba mixer small (transformers 5.17's torch path of the defaults asks 40 GB)
          "falcon_h1": (dict(lm_head_multiplier=0.5, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16,
                             mamba_chunk_size=8), dict(scale=0.5)),
          "gemma2": (dict(final_logit_softcapping=0.5, attn_logit_softcapping=50.0, query_pre_attn_scalar=16,
                          sliding_window=4), dict(cap=0.5)),
          "gemma3_text": (dict(final_logit_softcapping=0.5, query_pre_attn_scalar=16), dict(cap=0.5)),
          # its forward reads more of its decoder's output (shared_kv_states): the stand-in had failed, and the cap
          # went unapplied, 3.7e-3 off at a cap of 0.05
          "gemma4_text": (dict(final_logit_softcapping=0.05, hidden_size_per_layer_input=8,
                               vocab_size_per_layer_input=97, layer_types=["sliding_attention", "full_attention"],
                               sliding_window=4), dict(cap=0.05)),
          "gpt_neox": (dict(rotary_pct=0.5), {})}


@pytest.mark.parametrize("model_type", sorted(SCALED))
def test_the_loss_reads_the_logits_the_models_own_forward_makes(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.loss import Logits, logit_transform

    extra, transform = SCALED[model_type]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    exs = examples()
    with torch.no_grad():  # transformers' own logits, each example alone
        logits = torch.cat([m(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0] for e in exs])
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    want = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
    found = logit_transform(m)
    assert found.scale == pytest.approx(Logits(**transform).scale, rel=1e-6) and found.cap == Logits(**transform).cap
    attach_loss(m, chunk=7)
    with torch.no_grad():
        got = compute_loss(m, with_loss_positions(collate(exs, pad_id=0, packing=False))).item()
    assert got == pytest.approx(want, rel=1e-6)
    if found.cap is not None:  # the cap matters here: the head's logits alone give another loss (6.1e-4 off)
        with torch.no_grad():
            heads = torch.cat([m.lm_head(m.model(input_ids=torch.tensor([e["input_ids"]]),
                                                 use_cache=False).last_hidden_state[0]) for e in exs])
        plain = F.cross_entropy(heads, targets, ignore_index=-100, reduction="sum").item()
        assert abs(plain - want) / want > 3e-4, (plain, want)


def test_a_forward_that_changes_the_logits_otherwise_is_refused():
    from transformers import AutoConfig, LlamaForCausalLM

    class Shifted(LlamaForCausalLM):  # a forward that adds to its head's logits
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + 1.0
            return out

    cfg = AutoConfig.for_model("llama", **COMMON)
    with pytest.raises(LLMTrainError, match="changes its LM head's logits in a way other than a scale"):
        attach_loss(Shifted(cfg), chunk=7)
    plain = LlamaForCausalLM(cfg)
    decoder, head = plain.model, plain.lm_head
    attach_loss(plain, chunk=7)  # a forward that returns its head's logits: attached
    assert plain.model is decoder and plain.lm_head is head  # the stand-ins put back


def test_a_distillation_teacher_s_logits_are_its_own_forward_s():
    """The teacher's logits in the divergence are made from its hidden states and head: scaled and capped as its
    own forward makes them (a Gemma 2 teacher's cap)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import llmtrain.objectives.distill as distill

    for model_type, extra in [("granite", dict(logits_scaling=8.0)), ("gemma2", SCALED["gemma2"][0])]:
        cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
        torch.manual_seed(0)
        teacher = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
        objective = distill.Distill(SimpleNamespace(temperature=0.5, beta=0.0), teacher=teacher, model=None,
                                    pad_id=0, packing=True, seed=0, stop_ids=[2], world=1)
        ids = torch.tensor([examples()[1]["input_ids"]])
        with torch.no_grad():
            own = teacher(input_ids=ids, use_cache=False).logits[0]
            hidden = teacher.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        seen = {}

        def spy(student, teacher_logits, beta):
            seen["teacher"] = teacher_logits
            return student.sum(-1), student.sum(-1)

        original, distill.divergence = distill.divergence, spy
        try:
            objective._token_loss(hidden)(own.clone(), torch.zeros(len(ids[0]), dtype=torch.long), 0)
        finally:
            distill.divergence = original
        assert torch.allclose(seen["teacher"], own / 0.5, rtol=1e-5, atol=1e-5), model_type


def test_generation_attends_as_the_model_does():
    """Generating (samples, rollouts, `llmtrain generate`) swaps the varlen attention for one with a KV cache: SDPA, or
    the eager attention of a model SDPA does not compute (GPT-OSS's sinks: SDPA left them out without a word, its
    logits 0.23 off here, 45% of the largest)."""
    from llmtrain.model.generate import cached_attention

    ids = torch.tensor([examples()[3]["input_ids"]])
    for model_type in ("gpt_oss", "llama4_text"):
        with torch.no_grad():
            want = model(model_type, "eager").eval()(input_ids=ids, use_cache=False).logits
            m = model(model_type, register()).eval()
            with cached_attention(m):
                got = m(input_ids=ids).logits  # with a KV cache, as generate runs it
                assert m.config._attn_implementation == ("eager" if model_type == "gpt_oss" else "sdpa")
        assert (got - want).abs().max() < 1e-5, model_type


def test_doctor_says_whether_the_model_is_a_family_of_the_table(tmp_path):
    from transformers import AutoConfig

    from llmtrain.config import load_recipe
    from llmtrain.doctor import check_family

    AutoConfig.for_model("olmo3", **COMMON).save_pretrained(tmp_path / "olmo3")
    [(name, status, detail)] = check_family(load_recipe(REPO / "recipes" / "tiny.yaml",
                                                        [f"model.name_or_path={tmp_path / 'olmo3'}"]))
    assert (name, status) == ("model family", "warn") and detail.startswith(
        "olmo3 is not a family of the capability table") and "Try a short run" in detail
    AutoConfig.for_model("gpt_oss", **COMMON, **OTHER["gpt_oss"]).save_pretrained(tmp_path / "oss")
    [(name, status, detail)] = check_family(load_recipe(REPO / "recipes" / "tiny.yaml",
                                                        [f"model.name_or_path={tmp_path / 'oss'}"]))
    assert (name, status) == ("model family", "pass") and detail.startswith("GPT-OSS (gpt_oss): a family of the")
    [(name, status, detail)] = check_family(load_recipe(REPO / "recipes" / "tiny.yaml",
                                                        [f"model.name_or_path={tmp_path / 'none'}"]))
    assert (name, status) == ("model", "fail") and "does not exist" in detail  # as finetune refuses it (audit 53)


def test_the_estimate_reads_a_checkpoints_text_model_and_refuses_a_layer_it_does_not_know(tmp_path):
    """Gemma 4's checkpoints (a gemma4 config, its text model under text_config), dense or with experts beside each
    MLP, are estimated as their text model (GPT-OSS's and Gemma 4's layers: tests/test_memory_families.py); another
    model_type is one the estimate does not know, said with how to measure the run."""
    from transformers import AutoConfig, Gemma4Config

    from llmtrain.memory.params import load_model_shape

    AutoConfig.for_model("gpt_oss", **COMMON, **OTHER["gpt_oss"]).save_pretrained(tmp_path / "oss")
    for folder, own in (("gemma4", {}), ("gemma4-moe", dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                             moe_intermediate_size=32))):
        Gemma4Config(text_config=AutoConfig.for_model("gemma4_text", **COMMON, **own).to_dict(), vision_config=None,
                     audio_config=None).save_pretrained(tmp_path / folder)
    AutoConfig.for_model("olmo3", **COMMON).save_pretrained(tmp_path / "olmo3")
    assert load_model_shape(str(tmp_path / "oss")).sinks
    dense, moe = (load_model_shape(str(tmp_path / folder)) for folder in ("gemma4", "gemma4-moe"))
    assert dense.per_layer_input > 0 and dense.experts is None and moe.experts.beside and moe.experts.count == 4
    with pytest.raises(LLMTrainError) as refused:
        load_model_shape(str(tmp_path / "olmo3"))
    said = str(refused.value)
    assert "has model_type 'olmo3', whose layer it does not know" in said and "short run" in said, said


def test_a_gpt_oss_checkpoint_stored_in_mxfp4_trains_dequantized_and_its_final_model_is_dense(tiny_assets, tmp_path):
    """GPT-OSS's hub checkpoints store the experts in MXFP4, which does not train; transformers keeps it where its
    kernels are installed (a GPU with triton and `kernels`) and dequantizes elsewhere. llmtrain asks it to
    dequantize, whatever is installed (modeling.dequantized: Mxfp4Config(dequantize=True)): the experts load as the
    dense weights transformers' own conversion gives, to the bit, train (the loss falls), and final/ is a dense
    GPT-OSS without a quantization_config; a LoRA run on its experts merges back onto the base read again the same
    way (`llmtrain export --merge`). model.quantize on it is refused before anything is written."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from llmtrain.config import ModelConfig
    from llmtrain.model.modeling import load_model

    folder, dense = tiny_gpt_oss_mxfp4(tiny_assets, tmp_path / "mxfp4")
    original = AutoModelForCausalLM.from_pretrained
    with mock.patch.object(AutoModelForCausalLM, "from_pretrained", side_effect=original) as loads:
        model = load_model(ModelConfig(name_or_path=str(folder), dtype="float32"), None)
    asked = loads.call_args.kwargs["quantization_config"]
    assert type(asked).__name__ == "Mxfp4Config" and asked.dequantize
    for name, want in dense.items():
        assert torch.equal(model.get_parameter(name), want) and model.get_parameter(name).requires_grad, name

    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(folder), "attn_implementation": "auto"},
                          train={"max_steps": 12, "lr": 3e-3, "micro_batch_size": 8})
    refused = cli("finetune", str(recipe), "model.quantize=nf4", "model.dtype=bfloat16", "lora.r=4", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "model.quantize=nf4: the checkpoint is stored in MXFP4" in refused.stderr
    assert "Unset model.quantize" in refused.stderr and not (tmp_path / "run").exists()
    estimated = cli("estimate-memory", "--model", str(folder), "--method", "lora", "--quantize", "nf4", check=False)
    assert estimated.returncode == 2 and "--quantize nf4: the checkpoint is stored in MXFP4" in estimated.stderr
    run_train(recipe)
    lines = records(tmp_path / "run")
    first, last = (sum(r["loss"] for r in part) / 3 for part in (lines[:3], lines[-3:]))
    assert last < 0.9 * first, (first, last)
    final = tmp_path / "run" / "final"
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    trained = AutoModelForCausalLM.from_pretrained(final)
    name = next(iter(dense))
    assert trained.get_parameter(name).shape == dense[name].shape
    assert not torch.equal(trained.get_parameter(name), dense[name])  # the experts trained

    # LoRA on its attention alone (all-linear reaches no expert of GPT-OSS's, so lora.dropout's default is no refusal
    # there): the start-up says how to reach them
    said = cli("finetune", str(recipe), "lora.r=4", "train.max_steps=1", f"output_dir={tmp_path / 'attention-only'}")
    [note] = [x for x in " ".join(said.stdout.split()).split("; ") if "lora.target_parameters" in x] or [""]
    assert "[mlp.experts.gate_up_proj, mlp.experts.down_proj] adapts them too" in note, said.stdout[-2000:]

    # LoRA on its experts, merged back by `llmtrain export --merge`, which reads the MXFP4 base again dequantized
    from llmtrain.run.export import export_merged

    lora = write_recipe(tiny_assets, tmp_path, name="lora.yaml", model={"name_or_path": str(folder),
                                                                        "attn_implementation": "auto"},
                        lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_parameters": [
                            "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
                        train={"max_steps": 4, "lr": 1e-2}, output_dir=str(tmp_path / "lora-run"))
    run_train(lora)
    merged = AutoModelForCausalLM.from_pretrained(export_merged(tmp_path / "lora-run"))
    assert type(merged.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    assert not torch.equal(merged.get_parameter(name), dense[name])  # the experts' adapters merged in


DECODERS = {  # decoders whose layers are not `model.layers`: GPT-2's transformer.h, GPT-NeoX's gpt_neox.layers
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, vocab_size=97, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                 embd_pdrop=0.0),
    "gpt_neox": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=97,
                     max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0),
}


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_a_decoder_whose_layers_are_not_model_layers_trains_packed_and_counts_its_flops(model_type):
    """GPT-2 and GPT-NeoX (Pythia) pass doctor as models that train through transformers, and finetune had ended in
    an AttributeError traceback counting their FLOPs (`lm.model.layers`): the layers are found where the decoder
    keeps them, and a packed row on the varlen attention is each example alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.run.metrics import flop_model

    def build(attn: str):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **DECODERS[model_type]),
                                                dtype=torch.float32, attn_implementation=attn)

    exs, ref = examples(), build("eager")
    logits = torch.cat([ref(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0] for e in exs])
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    want = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
    packed = build(register())
    attach_loss(packed, chunk=7)
    assert compute_loss(packed, with_loss_positions(collate(exs, pad_id=0, packing=True))).item() == pytest.approx(
        want, rel=1e-6)
    layers = ref.transformer.h if model_type == "gpt2" else ref.gpt_neox.layers
    weights = sum(p.numel() for p in layers.parameters() if p.ndim >= 2)
    assert flop_model(ref).body_per_token == 6 * weights > 0


def test_the_decoder_layers_are_found_where_a_decoder_nests_them():
    """OPT keeps them at model.decoder.layers (a StopIteration had ended the search)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.loss import decoder_layers

    opt = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "opt", hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=97,
        word_embed_proj_dim=32, max_position_embeddings=64))
    assert decoder_layers(opt) is opt.model.decoder.layers


def test_the_start_up_line_names_the_attention_and_the_tensor_plan_that_run(monkeypatch):
    """Audit 58: GPT-OSS's varlen attention was said to be "SDPA per example" (its sinks take an explicit softmax per
    example off CUDA, a rescaled flash kernel on it), eager attention "a packed row gets a block-diagonal mask" where no
    row is packed, and GPT-OSS's tensor parallelism "the model's own plan" (llmtrain's: its own splits only the
    embedding)."""
    from llmtrain.config import ModelConfig
    from llmtrain.model import attention
    from llmtrain.model.modeling import describe_attention

    auto, eager = (ModelConfig(name_or_path="unused", attn_implementation=a) for a in ("auto", "eager"))
    monkeypatch.setattr(attention, "varlen_available", lambda: True)  # CUDA's flash kernel, rescaled by the sinks
    assert describe_attention(auto, packed=True, sinks=True) == \
        "varlen (flash varlen_attn in bf16/fp16, rescaled by the sinks, cost sum of l_i^2) [auto]"
    monkeypatch.setattr(attention, "varlen_available", lambda: False)  # elsewhere
    assert describe_attention(eager, packed=False) == "eager (transformers; each example a padded row)"
    assert describe_attention(eager, packed=True) == "eager (transformers; a packed row gets a block-diagonal mask)"
    assert describe_attention(auto, packed=True) == "varlen (SDPA per example, cost sum of l_i^2) [auto]"
    assert describe_attention(auto, packed=True, sinks=True) == \
        "varlen (a softmax with the sinks per example, cost sum of l_i^2) [auto]"
    assert capabilities.tensor_plan_source(config("gpt_oss")) == "llmtrain's plan for gpt_oss"
    assert capabilities.tensor_plan_source(SimpleNamespace(model_type="llama")) == "the model's own plan"


def test_the_estimate_of_a_model_refuses_gpt_oss_packed_under_eager_as_training_does(tmp_path):
    """Review of audit 58's fix: estimate-memory --model skipped the sinks rule, so GPT-OSS packed under eager (a
    token budget, or --packing) was estimated, a run training refuses."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.memory.cli import _check_attention

    config("gpt_oss").save_pretrained(tmp_path)
    spec = SimpleNamespace(attn_implementation="eager", packing=False, micro_batch_tokens=512)
    with pytest.raises(LLMTrainError, match=r"train.micro_batch_tokens=512 \(a token budget packs every micro-batch\) "
                                            r"with model.attn_implementation=eager: gpt_oss's attention has sinks"):
        _check_attention(str(tmp_path), spec)
    _check_attention(str(tmp_path), SimpleNamespace(attn_implementation="eager", packing=False,
                                                    micro_batch_tokens=None))  # padded rows: as training takes them
