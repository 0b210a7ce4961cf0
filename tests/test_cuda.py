"""The CUDA-only kernels against their CPU-checked references, on a real GPU (skipped without one).

benchmarks/gpu_session.sh smoke runs this file first on the H100. What the CPU suite cannot reach:
- torch's flash varlen_attn through llmtrain's call (GQA handed to the kernel as is on torch 2.11, the window,
  the model's scale), forward and backward, against SDPA per example;
- a packed varlen forward and backward of a tiny Mistral under bf16 autocast against the same examples unpacked;
- attention sinks (GPT-OSS) on the flash kernel, with the log-sum-exp gradient it leaves out restored.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("hq", "hkv"), [(8, 8), (8, 2)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("scale", [None, 0.1])
def test_flash_varlen_equals_sdpa_per_example(hq, hkv, window, scale):
    from llmtrain.model.attention import _flash_varlen, _sdpa_per_example, varlen_available

    assert varlen_available()
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 14, 17, 40, 41], dtype=torch.int32)
    t, d = int(cu[-1]), 64
    base = [torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    grad = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    s = d ** -0.5 if scale is None else scale
    outs, grads = [], []
    for fn in (lambda q, k, v: _flash_varlen(q, k, v, cu.cuda(), 23, scale=s, window=window),
               lambda q, k, v: _sdpa_per_example(q.float(), k.float(), v.float(), cu.tolist(), scale=s, dropout=0.0,
                                                 window=window, gqa=hq // hkv)):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = fn(q, k, v)
        out.float().backward(grad.float())
        outs.append(out.float())
        grads.append([x.grad.float() for x in (q, k, v)])
    assert (outs[0] - outs[1]).abs().max() < 2e-2
    for a, b in zip(grads[0], grads[1]):
        assert (a - b).abs().max() < 5e-2 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("window", [None, 6])
def test_flash_varlen_computes_attention_sinks_as_the_per_example_path(window):
    """GPT-OSS's sinks on the real kernel: its output times sigmoid(lse - sink) and the log-sum-exp's gradient that
    the kernel leaves out (attention._SinkShare), against the per-example path in fp32 (tests/test_fastpath.py checks
    the same against a stand-in kernel on the CPU)."""
    from llmtrain.model.attention import _flash_varlen, _sdpa_per_example, varlen_available

    assert varlen_available()
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 14, 17, 40, 41], dtype=torch.int32)
    t, d, hq, hkv = int(cu[-1]), 64, 8, 2
    base = [torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    sinks0 = torch.randn(hq, device="cuda")
    grad = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for fn in (lambda q, k, v, z: _flash_varlen(q, k, v, cu.cuda(), 23, scale=0.125, window=window, sinks=z),
               lambda q, k, v, z: _sdpa_per_example(q.float(), k.float(), v.float(), cu.tolist(), scale=0.125,
                                                    dropout=0.0, window=window, gqa=hq // hkv, sinks=z)):
        q, k, v = (x.clone().requires_grad_() for x in base)
        z = sinks0.clone().requires_grad_()
        out = fn(q, k, v, z)
        out.float().backward(grad.float())
        outs.append(out.float())
        grads.append([x.grad.float() for x in (q, k, v, z)])
    assert (outs[0] - outs[1]).abs().max() < 2e-2
    for a, b in zip(grads[0], grads[1]):
        assert (a - b).abs().max() < 5e-2 * max(1.0, b.abs().max().item())


def test_packed_varlen_loss_and_grads_equal_padded_sdpa_under_bf16_autocast():
    """What training runs: one packed row through the flash varlen kernel against the same examples padded
    through SDPA, a tiny Mistral with GQA and a sliding window shorter than an example, fp32 weights, bf16
    autocast; the summed loss and every gradient agree to bf16 precision."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from llmtrain.data.batching import collate, to_device, with_loss_positions
    from llmtrain.model.attention import register
    from llmtrain.model.loss import attach_loss, compute_loss

    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=24)
    g = torch.Generator().manual_seed(1)
    exs = [{"input_ids": torch.randint(0, 512, (n,), generator=g).tolist(),
            "labels": torch.randint(0, 512, (n,), generator=g).tolist()} for n in (7, 30, 19, 3)]
    models = []
    for attn, packing in ((register(), True), ("sdpa", False)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).cuda()
        attach_loss(model, chunk=16)
        batch = with_loss_positions(collate(exs, pad_id=0, packing=packing))
        batch = to_device(batch, torch.device("cuda"))  # as train_step moves it: cu_seq_lens too
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compute_loss(model, batch)
        loss.backward()
        models.append((loss.item(), model))
    (a, varlen), (b, sdpa) = models
    assert a == pytest.approx(b, rel=1e-2)
    for (name, p), q in zip(varlen.named_parameters(), sdpa.parameters()):
        assert (p.grad - q.grad).abs().max() <= 5e-2 * q.grad.abs().max() + 1e-4, name


# --------------------------------------------------------------------------- the fast sampler (rl.sampler)


def _sampling_model(dtype: torch.dtype):
    """A tiny Mistral (GQA, a window shorter than prompt + completion) under all-linear LoRA with a non-zero B."""
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=24)
    model = MistralForCausalLM(cfg)
    with torch.no_grad():  # sharper distributions than a random init's nearly flat ones: fewer near ties
        model.lm_head.weight.mul_(10)
    model = model.to("cuda", dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_captured_sampler_equals_the_eager_one_and_the_reference_loop(dtype, temperature):
    """The decode step replayed as a CUDA graph draws exactly what the same step run eagerly draws (the same
    kernels). Against the reference loop (another attention shape, another cache) the logits are equal up to
    rounding: a uniform near a boundary of the cumulative distribution can draw the neighbouring token and change a
    completion from there on. Greedy, all are equal; sampling in fp32, all but at most one of the 32 (on the CPU
    1 in 256 differed at scale, docs/rl.md); in bf16, at least 3 in 4."""
    from llmtrain.model.fast_sample import sample_fast
    from llmtrain.model.generate import completion_seed, sample

    lm = _sampling_model(dtype)
    g = torch.Generator().manual_seed(2)
    distinct = [[1, *torch.randint(3, 512, (n,), generator=g).tolist()] for n in (5, 40, 17, 29)]
    prompts = [p for p in distinct for _ in range(8)]
    kwargs = dict(seeds=[completion_seed(3, 1, i // 8, i % 8) for i in range(32)], max_new_tokens=40,
                  temperature=temperature, top_p=1.0 if temperature == 0 else 0.9, stop_ids={2, 7}, pad_id=0)
    captured = sample_fast(lm, prompts, capture=True, **kwargs)
    eager = sample_fast(lm, prompts, **kwargs)
    reference = sample(lm, prompts, **kwargs)
    assert captured == eager
    assert any(len(c) == 40 for c in eager)
    same = sum(a == b for a, b in zip(eager, reference))
    print(f"{dtype} temperature {temperature}: {same} of {len(prompts)} completions equal to the reference loop's")
    if temperature == 0:
        assert same == len(prompts)
    else:
        assert same >= (len(prompts) - 1 if dtype == torch.float32 else 0.75 * len(prompts))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_captured_sampler_applies_the_repetition_penalty_as_the_eager_one(temperature):
    """rl.repetition_penalty on CUDA: the seen-token flags are updated in place inside the captured step (and move
    with the rows compaction keeps), so the replayed graph draws what the eager step draws, and greedy what the
    reference loop draws; the penalty changes the completions."""
    from llmtrain.model.fast_sample import sample_fast
    from llmtrain.model.generate import completion_seed, sample

    lm = _sampling_model(torch.float32)
    g = torch.Generator().manual_seed(4)
    distinct = [[1, *torch.randint(3, 512, (n,), generator=g).tolist()] for n in (5, 40, 17, 29)]
    prompts = [p for p in distinct for _ in range(8)]
    kwargs = dict(seeds=[completion_seed(3, 1, i // 8, i % 8) for i in range(32)], max_new_tokens=40,
                  temperature=temperature, top_p=1.0, stop_ids={2, 7}, pad_id=0, repetition_penalty=1.5)
    captured = sample_fast(lm, prompts, capture=True, **kwargs)
    assert captured == sample_fast(lm, prompts, **kwargs)
    assert captured != sample_fast(lm, prompts, capture=True, **{**kwargs, "repetition_penalty": 1.0})
    if temperature == 0:
        assert captured == sample(lm, prompts, **kwargs)


def test_the_captured_sampler_stops_at_an_end_of_turn_of_several_tokens():
    """A text end of turn (generate.Stops.sequences: `<|im_end|>` in a template for a tokenizer without it) is
    compared on the device inside the captured step: the captured sampler's completions are the eager one's, each the
    free completion cut after the first place a sequence is complete (tests/test_fast_sample.py on the CPU)."""
    from llmtrain.model.fast_sample import sample_fast
    from llmtrain.model.generate import Stops, completion_seed

    lm = _sampling_model(torch.float32)
    g = torch.Generator().manual_seed(4)
    distinct = [[1, *torch.randint(3, 512, (n,), generator=g).tolist()] for n in (5, 40, 17, 29)]
    prompts = [p for p in distinct for _ in range(8)]
    kwargs = dict(seeds=[completion_seed(3, 4, i // 8, i % 8) for i in range(32)], max_new_tokens=48,
                  temperature=1.0, top_p=1.0, pad_id=0)
    free = sample_fast(lm, prompts, capture=True, stop_ids=set(), **kwargs)
    sequences = [tuple(free[0][10:12]), tuple(free[9][30:33]), tuple(free[20][3:5])]

    def cut(row):
        for k in range(len(row)):
            if any(tuple(row[max(0, k + 1 - len(s)):k + 1]) == s for s in sequences):
                return row[:k + 1]
        return row

    stops = Stops((), sequences, "")
    captured = sample_fast(lm, prompts, capture=True, stop_ids=stops, **kwargs)
    assert captured == sample_fast(lm, prompts, stop_ids=stops, **kwargs)
    assert captured == [cut(c) for c in free] and sum(len(c) < 48 for c in captured) >= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_captured_sampler_on_a_merged_copy_dropping_finished_rows(dtype):
    """Issue 56 on CUDA: the captured step on the merged generation copy with finished rows dropped (graphs captured
    per batch size) draws exactly what the same run eagerly draws. Dropping rows against keeping them (adapters
    unmerged both): equal up to rounding (a smaller batch can pick another matmul kernel): in fp32 all but one of 32,
    in bf16 at least 3 in 4. The merged copy against the unmerged adapters: in fp32 all but one; in bf16 it is
    printed, not bounded (a bf16 copy is a rounded policy: on the CPU 15 of 32 alike here, docs/rl.md)."""
    from collections import Counter

    from llmtrain.model import fast_sample
    from llmtrain.model.fast_sample import sample_fast
    from llmtrain.model.generate import completion_seed

    lm = _sampling_model(dtype)
    g = torch.Generator().manual_seed(3)
    distinct = [[1, *torch.randint(3, 512, (n,), generator=g).tolist()] for n in (5, 40, 17, 29)]
    prompts = [p for p in distinct for _ in range(8)]
    kwargs = dict(seeds=[completion_seed(3, 2, i // 8, i % 8) for i in range(32)], max_new_tokens=64,
                  temperature=1.0, top_p=0.9, stop_ids=set(), pad_id=0)
    free = sample_fast(lm, prompts, **kwargs)  # the tokens drawn most often stop rows at very different lengths
    kwargs["stop_ids"] = {t for t, _ in Counter(t for c in free for t in c).most_common(3)}
    sizes = []
    compact = fast_sample._Decode.compact
    fast_sample._Decode.compact = lambda self, live, filled: sizes.append(live.numel()) or compact(self, live, filled)
    try:
        captured = sample_fast(lm, prompts, capture=True, copy="rollout", **kwargs)
        eager = sample_fast(lm, prompts, copy="rollout", **kwargs)
    finally:
        fast_sample._Decode.compact = compact
    assert captured == eager and sizes and sizes[: len(sizes) // 2] == sizes[len(sizes) // 2:]
    dropped = sample_fast(lm, prompts, capture=True, **kwargs)
    kept = sample_fast(lm, prompts, capture=True, compact=False, **kwargs)
    same, merged = sum(a == b for a, b in zip(dropped, kept)), sum(a == b for a, b in zip(captured, dropped))
    print(f"{dtype}: compacted to {sizes[: len(sizes) // 2]} rows; rows dropped vs kept {same} of 32 alike; merged "
          f"vs unmerged {merged} of 32")
    assert same >= (len(prompts) - 1 if dtype == torch.float32 else 0.75 * len(prompts))
    assert dtype != torch.float32 or merged >= len(prompts) - 1


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_p": 0.9, "top_k": 50, "min_p": 0.05,
                                                         "repetition_penalty": 1.3}])
def test_the_sampler_holds_on_cuda_what_the_estimate_prices_for_its_filters(filters):
    """act.sampler_bytes (tests/test_memory_sampling.py: equal to the CPU's live bytes to 0.1%) against
    torch.cuda.max_memory_allocated over one decode step of 64 rows of a 128K vocabulary in bf16: what CUDA adds
    (the sort's own scratch) shows here; printed for docs/memory.md, and held within 25% above the price."""
    from llmtrain.memory.activations import sampler_bytes
    from llmtrain.model.generate import next_tokens, seen_tokens

    rows, vocab = 64, 128256
    settings = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **filters}
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda") * 3).bfloat16()  # the head's, and the penalty's seen flags:
    seen = (seen_tokens([[1, 2, 3]] * rows, vocab, "cuda") if settings["repetition_penalty"] != 1.0 else None)
    uniforms = torch.rand(rows, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = logits.numel() * logits.element_size() + (seen.numel() if seen is not None else 0)  # in the price
    before = torch.cuda.memory_allocated() - held
    torch.cuda.reset_peak_memory_stats()
    next_tokens(logits, uniforms, seen=seen, **settings)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    predicted = sampler_bytes(rows, vocab, 2, **settings)
    print(f"sampler {filters}: measured {measured:,} B, priced {predicted:,} B ({measured / predicted - 1:+.1%})")
    assert predicted * 0.98 <= measured <= predicted * 1.25


def test_the_entropy_bonus_chunk_on_cuda_equals_autograds():
    """The entropy bonus's fused chunk (loss._CrossEntropyAndEntropy: the cross-entropy and the entropy of each row,
    one gradient buffer written block by block) on CUDA against autograd through log_softmax, fp32 logits of a 32K
    vocabulary: values and the logits' gradient to fp32 rounding."""
    from llmtrain.model.loss import _CrossEntropyAndEntropy

    torch.manual_seed(0)
    z = (torch.randn(300, 32768, device="cuda") * 3).requires_grad_()
    t = torch.randint(0, 32768, (300,), device="cuda")
    g_loss, g_entropy = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    loss, entropy = _CrossEntropyAndEntropy.apply(z, t)
    (loss * g_loss + entropy * g_entropy).sum().backward()
    ours, z.grad = z.grad, None
    lsm = z.log_softmax(-1)
    loss2, entropy2 = torch.nn.functional.cross_entropy(z, t, reduction="none"), -(lsm.exp() * lsm).sum(-1)
    (loss2 * g_loss + entropy2 * g_entropy).sum().backward()
    assert (loss - loss2).abs().max() < 1e-4 and (entropy - entropy2).abs().max() < 1e-4
    assert (ours - z.grad).abs().max() < 1e-5
