"""rl.sampler_correction (TRL's vLLM importance sampling correction): the sampler's own log-probability of each token
it draws, and the loss that weighs each token's policy term by the policy's probability over the sampler's.

The samplers' log-probabilities are those of the distribution each token was drawn from (vLLM's processed logprobs):
transformers' own logits processors (repetition penalty, temperature, top_k, top_p) applied to a full forward's
logits give them to 1e-6, and the three samplers agree. Against TRL 1.16's GRPOTrainer driven through its vLLM path
(its vLLM replaced by llmtrain's sampler, drawing from a policy 0.05 away, so the ratios are off 1 and the bounds
bind): the same loss, gradients and sampling/* metrics, mode by mode.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmtrain.model.fast_sample import sample_fast
from llmtrain.model.generate import next_tokens, sample
from llmtrain.objectives.grpo import (loss_units, off_policy_keep, sampler_weights, token_losses, token_weights,
                                      vespo_weights)

trl = pytest.importorskip("trl")

MAX_COMPLETION = 6


def tiny_model(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32,
                                                attn_implementation="sdpa")


def processed_logps(logits: torch.Tensor, seen: torch.Tensor, drawn: torch.Tensor, *, temperature: float,
                    top_p: float, top_k: int, repetition_penalty: float) -> torch.Tensor:
    """The drawn tokens' log-probabilities under transformers' processors of `logits` (as vLLM's processed logprobs
    are): the penalty over `seen`, the temperature, top_k, top_p, then log_softmax."""
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    rows = [row.nonzero().squeeze(1) for row in seen]  # the penalty reads them as input_ids: each row's seen
    width = max(len(r) for r in rows)  # tokens, padded by repeating its first
    input_ids = torch.stack([torch.cat([r, r[:1].repeat(width - len(r))]) for r in rows])
    processed = processors(input_ids, logits.clone())
    return torch.log_softmax(processed, dim=-1).gather(1, drawn[:, None]).squeeze(1)


@pytest.mark.parametrize("settings", [dict(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0),
                                      dict(temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.0),
                                      dict(temperature=1.3, top_p=0.8, top_k=40, repetition_penalty=1.2)])
def test_a_drawn_tokens_logp_is_its_processed_distributions(settings):
    """next_tokens' log-probability of each drawn token is transformers' processed distribution's (the penalty, the
    temperature, top_k and top_p applied to the logits, renormalised): to 1e-6, on 64 rows of a 1,000-token
    vocabulary whose filters cut (the logits spread wide)."""
    torch.manual_seed(0)
    logits = 4 * torch.randn(64, 1000)
    seen = torch.rand(64, 1000) < 0.01
    seen[:, 0] = True
    logps = torch.empty(64)
    drawn = next_tokens(logits, torch.rand(64), seen=seen, logps=logps, **settings)
    want = processed_logps(logits, seen, drawn, **settings)
    assert torch.isfinite(want).all()
    assert (logps - want).abs().max().item() < 1e-6
    if settings["top_p"] < 1.0:  # the filter moved them: renormalised over what it kept
        plain = torch.log_softmax(logits / settings["temperature"], dim=-1).gather(1, drawn[:, None]).squeeze(1)
        assert (logps - plain).min().item() > 0 and (logps - plain).mean().item() > 1e-2


@pytest.mark.parametrize("settings", [dict(temperature=1.0, top_p=1.0), dict(temperature=0.8, top_p=0.95, top_k=30,
                                                                             repetition_penalty=1.1)])
def test_the_samplers_give_the_same_logps_and_a_forward_gives_them_too(tiny_assets, settings):
    """The reference loop and the static sampler (compacting its batch) draw the same tokens with the same
    log-probabilities (to 1e-6); without filters they are the policy's own: a full forward's log_softmax at the
    temperature, to 1e-5."""
    lm = tiny_model(tiny_assets).eval()
    prompts = [[1, 5, 9, 12, 7], [1, 5, 30, 31], [1, 44], [1, 8, 8, 8, 2, 6]]
    seeds = [11, 12, 13, 14]
    common = dict(seeds=seeds, max_new_tokens=12, stop_ids={2}, pad_id=0, **settings)
    ref = sample(lm, prompts, logps=True, **common)
    fast = sample_fast(lm, prompts, logps=True, **common)
    assert [d.ids for d in ref] == [d.ids for d in fast]
    assert [len(d.logps) for d in fast] == [len(d.ids) for d in fast]
    assert [d.ids for d in fast] == sample_fast(lm, prompts, **common)  # the same draws as without them
    worst = max(abs(a - b) for r, f in zip(ref, fast) for a, b in zip(r.logps, f.logps))
    assert worst < 1e-6
    if settings["top_p"] == 1.0:
        with torch.no_grad():
            for p, d in zip(prompts, fast):
                logits = lm(torch.tensor([p + d.ids])).logits[0, len(p) - 1:-1] / settings["temperature"]
                want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(d.ids)[:, None]).squeeze(1)
                assert (torch.tensor(d.logps) - want).abs().max().item() < 1e-5


def test_sampler_weights_by_hand():
    """Two completions (3 and 2 tokens), each token's policy minus sampler log-probability known: token_* a ratio a
    token, sequence_* the product over a completion; truncate clamps to [min, max], mask zeroes outside them."""
    policy = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.2])
    sampler = policy - torch.tensor([math.log(4.0), 0.0, math.log(0.5), math.log(2.0), math.log(2.0)])
    completion = torch.tensor([0, 0, 0, 1, 1])
    w, r = sampler_weights(policy, sampler, completion, 2, mode="token_truncate", low=None, high=3.0)
    assert w.tolist() == pytest.approx([3.0, 1.0, 0.5, 2.0, 2.0]) and r.tolist() == w.tolist()
    w, _ = sampler_weights(policy, sampler, completion, 2, mode="token_mask", low=0.6, high=3.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, 0.0, 2.0, 2.0])
    w, r = sampler_weights(policy, sampler, completion, 2, mode="sequence_truncate", low=None, high=3.0)
    assert r.tolist() == pytest.approx([2.0, 3.0]) and w.tolist() == pytest.approx([2.0] * 3 + [3.0] * 2)
    w, r = sampler_weights(policy, sampler, completion, 2, mode="sequence_mask", low=None, high=3.0)
    assert r.tolist() == pytest.approx([2.0, 0.0]) and w.tolist() == pytest.approx([2.0] * 3 + [0.0] * 2)


class SamplerAsVLLM:
    """TRL's vLLM generation, replaced by llmtrain's static sampler drawing from `lm` (a policy away from the trained
    one): its completions and each token's log-probability, in vLLM's shapes; what it drew is kept."""

    def __init__(self, lm, pad_id: int, stop_id: int):
        self.lm, self.pad_id, self.stop_id, self.drawn, self.prompts = lm, pad_id, stop_id, None, None

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        self.prompts = [list(p) for p in prompts]
        self.drawn = sample_fast(self.lm, self.prompts, seeds=list(range(100, 100 + len(prompts))),
                                 max_new_tokens=MAX_COMPLETION, temperature=1.0, top_p=1.0, stop_ids={self.stop_id},
                                 pad_id=self.pad_id, logps=True)
        return None, [d.ids for d in self.drawn], [[[lp] for lp in d.logps] for d in self.drawn], None


@pytest.mark.parametrize("mode, loss_type, beta, low, high, opsm", [
    ("sequence_mask", "dapo", 0.0, None, 1.0, None),  # TRL's default mode (its bound 3 binds on none here)
    ("sequence_truncate", "grpo", 0.04, None, 0.5, None),
    ("token_truncate", "dapo", 0.04, 0.9, 1.05, None),
    ("token_mask", "dr_grpo", 0.0, 0.95, 1.05, None),
    ("token_mask", "vespo", 0.0, 0.95, 1.05, None),
    ("sequence_truncate", "dapo", 0.0, 0.1, 0.9, -0.02)])  # the off-policy mask reads the sampler's log-probs
def test_the_correction_equals_trls_vllm_path(tiny_assets, tmp_path, mode, loss_type, beta, low, high, opsm):
    """TRL's GRPOTrainer with use_vllm and its importance sampling correction, its vLLM llmtrain's sampler drawing
    from a policy 0.05 away (so the ratios are off 1: a completion's 0.03 to 1.2 here, and the bounds bind): its rollout
    (_generate_and_score_completions: the old log-probabilities, the ratios, their bounds, the sampling/* metrics)
    and _compute_loss, against llmtrain's pieces on the same completions (sampler_weights on the packed pass's
    log-probabilities, token_losses with them as a factor of the policy term, vespo's weight with their logs, the
    off-policy mask reading the sampler's): the loss to 1e-6 (vespo: rel 5e-6), every gradient to 1e-6, the metrics
    to 1e-5."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.data.formats import IGNORE
    from llmtrain.model.loss import attach_loss, compute_loss

    theirs_model, ours_model, sampler_model = (tiny_model(tiny_assets) for _ in range(3))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in sampler_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sampler_model.eval()
    theirs_model.train()  # TRL's metrics go to the train mode's
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=MAX_COMPLETION, loss_type=loss_type, beta=beta, temperature=1.0,
                      use_cpu=True, bf16=False, report_to=[], logging_steps=1, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_clip_min=low, vllm_importance_sampling_clip_max=high,
                      off_policy_mask_threshold=opsm)

    def reward(completions, **kw):  # the completions' lengths: advantages that differ in each group
        return [float(len(c)) for c in completions]

    data = datasets.Dataset.from_list([{"prompt": "a b c"}, {"prompt": "d e"}])
    trainer = GRPOTrainer(model=theirs_model, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    vllm = SamplerAsVLLM(sampler_model, pad_id=tok.pad_token_id, stop_id=tok.eos_token_id)
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, vllm, 0
    trainer.vllm_importance_sampling_correction = True
    if beta:
        reference = tiny_model(tiny_assets)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.02 * torch.randn_like(p))
        trainer.ref_model.load_state_dict(reference.state_dict())
    inputs = [{"prompt": "a b c"}] * 4 + [{"prompt": "d e"}] * 4
    out = trainer._generate_and_score_completions(inputs)
    theirs = trainer._compute_loss(theirs_model, out)
    theirs.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    prompts, completions = vllm.prompts, [d.ids for d in vllm.drawn]
    sequences = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompts, completions)]
    batch = with_loss_positions(collate(sequences, pad_id=0, packing=True))
    attach_loss(ours_model, chunk=4096)
    completion, n = batch["loss_example"], len(completions)
    with torch.no_grad():
        policy = -compute_loss(ours_model.eval(), batch, per_token=True).float()  # the policy as it sampled
        ref = None
        if beta:
            attach_loss(reference, chunk=4096)
            ref = -compute_loss(reference.eval(), batch, per_token=True).float()
    ours_model.train()
    sampled = torch.tensor([lp for d in vllm.drawn for lp in d.logps])
    weights, ratios = sampler_weights(policy, sampled, completion, n, mode=mode, low=low, high=high)
    advantages = out["advantages"].flatten()[completion]
    logps = -compute_loss(ours_model, batch, per_token=True).float()
    lengths = torch.bincount(completion, minlength=n)
    keep = weights if loss_type != "vespo" else None
    if opsm is not None:
        masked = off_policy_keep(logps, sampled, advantages, completion, lengths.float()[completion], n,
                                 threshold=opsm)
        assert 0 < masked.sum() < len(masked)  # it binds on some completions, not all
        keep = keep * masked
    phi = (vespo_weights(logps, policy, advantages, completion, n, k=(2.0, 3.0), lam=(3.0, 2.0),
                         sampler_weights=weights) if loss_type == "vespo" else None)
    loss, _, _ = token_losses(logps, advantages, old_logps=policy, ref_logps=ref, epsilon=0.2, epsilon_high=0.2,
                              beta=beta, keep=keep, weights=phi)
    ours = (loss * token_weights(completion, lengths, loss_type)).sum() / loss_units(
        lengths, loss_type, max_completion_tokens=MAX_COMPLETION)
    ours.backward()

    assert ours.item() == (pytest.approx(theirs.item(), rel=5e-6) if loss_type == "vespo" else
                           pytest.approx(theirs.item(), abs=1e-6))
    worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(ours_model.parameters(),
                                                                      theirs_model.parameters()))
    assert worst < 1e-6, worst
    difference = (policy - sampled).abs()
    assert difference.mean().item() == pytest.approx(metrics["sampling/sampling_logp_difference/mean"], abs=1e-5)
    assert difference.max().item() == pytest.approx(metrics["sampling/sampling_logp_difference/max"], abs=1e-5)
    for stat, value in (("min", ratios.min()), ("mean", ratios.mean()), ("max", ratios.max())):
        assert value.item() == pytest.approx(metrics[f"sampling/importance_sampling_ratio/{stat}"], abs=1e-5), stat
    # not vacuous: the correction changed the weights, and a bound bound
    raw = torch.exp(policy - sampled)
    if mode.startswith("sequence"):
        raw = torch.zeros(n).index_add(0, completion, policy - sampled).exp()
    assert (ratios - raw).abs().max().item() > 1e-3
    assert (weights - 1).abs().max().item() > 1e-2


@pytest.mark.parametrize("keys, says", [
    ({"sampler_correction_max": 2.0}, "rl.sampler_correction_max is read by rl.sampler_correction, which is off: set "
                                      "rl.sampler_correction"),
    ({"sampler_correction": "token_mask", "sampler_correction_min": 4.0}, "is above rl.sampler_correction_max=3: swap"),
    ({"sampler_correction": "sequence_mask", "sampler_correction_max": math.inf}, "with no bound"),
    ({"sampler_correction": "sequence_truncate", "loss_type": "vespo"}, "use token_truncate or token_mask"),
    ({"algorithm": "rloo", "sampler_correction": "token_mask"}, "rl.sampler_correction is read by rl.algorithm: grpo")])
def test_correction_settings_a_run_cannot_use_are_refused(keys, says):
    """Each in one sentence naming the key and the fix; on, the bound defaults to TRL's 3 and the floor to none."""
    from llmtrain.config import RLConfig

    rewards = [{"type": "format", "pattern": "x"}]
    with pytest.raises(ValueError, match=says):
        RLConfig(rewards=rewards, **keys)
    on = RLConfig(rewards=rewards, sampler_correction="sequence_mask")
    assert (on.sampler_correction_max, on.sampler_correction_min) == (3.0, None)
    assert RLConfig(rewards=rewards).sampler_correction_max is None
