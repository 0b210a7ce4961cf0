"""GRPO's loss and advantages (llmtrain/objectives/grpo.py) against TRL 1.16's GRPOTrainer, in fp32 on the tiny Llama.

TRL pads every completion to the longest (prompts on the left, completions on the right) and runs its own
`_compute_loss`; llmtrain packs the same prompt + completion sequences into one padding-free row with varlen
attention and takes per-token log-probabilities from the chunked loss path (no full logits). Same model, same
ids, same advantages: the same loss and the same gradients, to 1e-6, for dapo, grpo and dr_grpo, with beta 0 and
0.04. The advantages equal TRL's for scale_rewards group, batch and none, a group with equal rewards and a reward of
None (NaN) included.
"""

from __future__ import annotations

import re

import pytest
import torch

from llmtrain.objectives.grpo import (group_advantages, loss_units, off_policy_keep, sequence_log_ratios, token_losses,
                                      token_weights, vespo_weights)

trl = pytest.importorskip("trl")

PROMPTS = [[5, 9, 12, 7], [5, 30, 31]]  # token ids of the tiny Llama's vocabulary (BOS 1 first below)
COMPLETIONS = [[40, 41, 2], [42, 2], [43, 44, 45, 46, 2], [47]]  # 2 per prompt; 2 is EOS; the last one clipped
MAX_COMPLETION = 5


def tiny_model(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32,
                                                attn_implementation="sdpa").train()


def two_copies_and_a_moved_one(tiny_assets, scale: float):
    """TRL's copy, llmtrain's copy, and a third whose weights moved by `scale` x N(0, 1) (a reference, or the policy
    that sampled)."""
    theirs, ours, moved = tiny_model(tiny_assets), tiny_model(tiny_assets), tiny_model(tiny_assets)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn_like(p))
    return theirs, ours, moved


def trl_trainer(model, tiny_assets, tmp_path, *, loss_type: str, beta: float):
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=MAX_COMPLETION, loss_type=loss_type, beta=beta, temperature=1.0,
                      use_cpu=True, bf16=False, report_to=[], logging_steps=1)
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    data = datasets.Dataset.from_list([{"prompt": "abc"}] * 4)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=args, train_dataset=data, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def padded_inputs(prompts, completions, advantages, pad: int) -> dict:
    """TRL's layout: prompts left-padded, completions right-padded, with their masks."""
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (c_len - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for c in completions])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum()}


def with_trl_reference(trainer, inputs: dict, reference) -> None:
    """`reference`'s weights in TRL's ref_model, and its per-token log-probabilities in `inputs`, as TRL's rollout
    puts them there for a beta > 0 loss."""
    trainer.ref_model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, mask, inputs["completion_ids"].size(1), batch_size=4)


def packed_loss(model, prompts, completions, advantages, *, loss_type: str, beta: float, ref_model=None,
                kl_ratio: bool = True):
    """llmtrain's: the sequences packed into one row, per-token log-probabilities from the chunked loss."""
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.data.formats import IGNORE
    from llmtrain.model.loss import attach_loss, compute_loss

    sequences = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompts, completions)]
    batch = with_loss_positions(collate(sequences, pad_id=0, packing=True))
    attach_loss(model, chunk=4096)
    logps = -compute_loss(model, batch, per_token=True).float()
    completion = batch["loss_example"]
    lengths = torch.bincount(completion, minlength=len(completions))
    ref = None
    if beta:
        with torch.no_grad():
            attach_loss(ref_model, chunk=4096)
            ref = -compute_loss(ref_model, batch, per_token=True).float()
    loss, _, _ = token_losses(logps, advantages[completion], ref_logps=ref, epsilon=0.2, epsilon_high=0.2, beta=beta,
                              kl_ratio=kl_ratio)
    total = (loss * token_weights(completion, lengths, loss_type)).sum()
    return total / loss_units(lengths, loss_type, max_completion_tokens=MAX_COMPLETION)


@pytest.mark.parametrize("beta, correction", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_and_gradients_equal_trls_grpo_trainer(tiny_assets, tmp_path, loss_type, beta, correction):
    """Two copies of one model, TRL's (its trainer patches the forward) and llmtrain's (attach_loss patches it);
    with beta, a reference that differs from the policy (so the KL term is not 0), loaded into TRL's own ref_model
    and used by llmtrain as its reference forward; with TRL's use_bias_correction_kl (the KL term times the ratio:
    its gradient, not its value) and without (rl.use_bias_correction_kl: false), whose gradients differ."""
    prompts = [[1] + PROMPTS[i // 2] for i in range(4)]
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2])
    theirs_model, ours_model, reference = two_copies_and_a_moved_one(tiny_assets, 0.01)
    trainer = trl_trainer(theirs_model, tiny_assets, tmp_path, loss_type=loss_type, beta=beta)
    trainer.args.use_bias_correction_kl = correction
    inputs = padded_inputs(prompts, COMPLETIONS, advantages, pad=trainer.processing_class.pad_token_id)
    if beta:
        with_trl_reference(trainer, inputs, reference)
    theirs = trainer._compute_loss(theirs_model, inputs)
    theirs.backward()
    their_grads = {n: p.grad for n, p in theirs_model.named_parameters()}

    ours = packed_loss(ours_model, prompts, COMPLETIONS, advantages, loss_type=loss_type, beta=beta,
                       ref_model=reference.eval(), kl_ratio=correction)
    ours.backward()
    if beta:  # not vacuous: the other setting's gradient is another
        other = tiny_model(tiny_assets)
        packed_loss(other, prompts, COMPLETIONS, advantages, loss_type=loss_type, beta=beta,
                    ref_model=reference.eval(), kl_ratio=not correction).backward()
        assert max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(other.parameters(), ours_model.parameters())) > 1e-5
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert max(g.abs().max().item() for g in their_grads.values()) > 1e-3  # a gradient to compare, not zeros
    worst = max((p.grad - their_grads[n]).abs().max().item() for n, p in ours_model.named_parameters())
    assert worst < 1e-6, worst


@pytest.mark.parametrize("loss_type, epsilon_high, level, beta, delta, masked", [
    ("dapo", 0.28, "token", 0.0, None, None), ("grpo", None, "token", 0.0, None, None),
    ("dr_grpo", None, "token", 0.0, None, None), ("grpo", None, "sequence", 0.0, None, None),
    ("grpo", None, "sequence", 0.04, None, None), ("dapo", 0.28, "sequence", 0.0, None, None),
    ("dapo", None, "token", 0.04, 1.05, None), ("cispo", 1.02, "token", 0.0, None, None),
    ("cispo", 1.02, "token", 0.04, None, None), ("sapo", None, "token", 0.0, None, None),
    ("sapo", None, "token", 0.04, None, None), ("dapo", None, "token", 0.04, None, -0.3),
    ("grpo", None, "sequence", 0.0, None, -0.3), ("luspo", None, "sequence", 0.0, None, None),
    ("luspo", 0.28, "sequence", 0.04, None, None), ("vespo", None, "token", 0.0, None, None),
    ("vespo", None, "token", 0.04, None, None)])
def test_a_later_update_of_a_round_equals_trls_with_its_old_logps(tiny_assets, tmp_path, loss_type, epsilon_high,
                                                                  level, beta, delta, masked):
    """rl.num_iterations > 1: a round's later update divides by the log-probabilities of the policy that sampled
    (TRL's old_per_token_logps), so the ratio is not 1 and the clip binds (epsilon 0.2, DAPO's epsilon_high 0.28):
    the same loss, gradients and clipped share as TRL's _compute_loss given the same old log-probabilities (those
    of a policy 0.05 away, taken by each side's own path: TRL's padded forward, llmtrain's packed one). Per token,
    and per completion (importance_sampling_level sequence, GSPO: the mean log-ratio of its tokens; its KL term
    times that ratio; the clipped share of completions). With rl.delta (INTELLECT-2's cap of the unclipped ratio,
    here 1.05 so that it binds on this small move), as TRL's. cispo (MiniMax-M1's): the ratio capped at epsilon_high
    (1.02 here, so that the cap binds on this small move) weighs each token's policy gradient without gradient of its
    own; TRL's cispo_clip_ratio. sapo: the smooth gate at TRL's temperatures (1.0, and 1.05 below zero), each
    completion's mean as grpo; nothing clipped, no clip metric (TRL logs none). `masked`: rl.off_policy_mask_threshold
    (DeepSeek-V3.2's off-policy sequence masking), at -0.3 so that it binds on these random moves (the completions'
    mean drifts are -0.54 to 0.17): one of the two completions with a negative advantage loses its policy term.
    luspo: GSPO's ratio, each completion's token sum, the mean over completions. vespo: each completion's gamma
    weight of its whole ratio (TRL's defaults k 2 / 3, lambda 3 / 2) on its tokens' policy gradient, and TRL's
    vespo/phi_seq_mean."""
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.data.formats import IGNORE
    from llmtrain.model.loss import attach_loss, compute_loss

    prompts = [[1] + PROMPTS[i // 2] for i in range(4)]
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2])
    theirs_model, ours_model, sampler = two_copies_and_a_moved_one(tiny_assets, 0.05)
    trainer = trl_trainer(theirs_model, tiny_assets, tmp_path, loss_type=loss_type, beta=beta)
    trainer.epsilon_high = epsilon_high if epsilon_high is not None else trainer.epsilon_low
    trainer.importance_sampling_level = level
    trainer.args.delta = delta
    trainer.off_policy_mask_threshold = masked
    inputs = padded_inputs(prompts, COMPLETIONS, advantages, pad=trainer.processing_class.pad_token_id)
    reference = tiny_model(tiny_assets)  # another policy again, so that the KL term is not 0
    torch.manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    with torch.no_grad():  # the sampler's weights in TRL's model (whose forward its trainer patched), then back
        trained = {k: v.clone() for k, v in theirs_model.state_dict().items()}
        theirs_model.load_state_dict(sampler.state_dict())
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        inputs["old_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
            theirs_model, ids, mask, inputs["completion_ids"].size(1), batch_size=4)
        if beta:
            trainer.ref_model.load_state_dict(reference.state_dict())
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, mask, inputs["completion_ids"].size(1), batch_size=4)
        theirs_model.load_state_dict(trained)
    theirs = trainer._compute_loss(theirs_model, inputs)
    theirs.backward()

    sequences = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompts, COMPLETIONS)]
    batch = with_loss_positions(collate(sequences, pad_id=0, packing=True))
    for model in (ours_model, sampler, reference):
        attach_loss(model, chunk=4096)
    with torch.no_grad():
        old = -compute_loss(sampler.eval(), batch, per_token=True).float()
        ref = -compute_loss(reference.eval(), batch, per_token=True).float() if beta else None
    losses, entropy = compute_loss(ours_model, batch, per_token=True, stat="entropy")
    logps = -losses.float()
    completion = batch["loss_example"]
    lengths = torch.bincount(completion, minlength=len(COMPLETIONS))
    log_ratio = (sequence_log_ratios(logps, old, completion, lengths.float()[completion], len(COMPLETIONS))
                 if level == "sequence" else None)
    phi = (vespo_weights(logps, old, advantages[completion], completion, len(COMPLETIONS), k=(2.0, 3.0),
                         lam=(3.0, 2.0)) if loss_type == "vespo" else None)
    keep = None
    if masked is not None:
        keep = off_policy_keep(logps, old, advantages[completion], completion, lengths.float()[completion],
                               len(COMPLETIONS), threshold=masked)
        dropped = {int(c) for c, k in zip(completion, keep) if not k}
        assert dropped and all(advantages[c] < 0 for c in dropped) and len(dropped) < (advantages < 0).sum()
    loss, kl, clipped = token_losses(logps, advantages[completion], old_logps=old, ref_logps=ref, epsilon=0.2,
                                     epsilon_high=epsilon_high, beta=beta, log_ratio=log_ratio, delta=delta,
                                     cispo=loss_type == "cispo", sapo=(1.0, 1.05) if loss_type == "sapo" else None,
                                     keep=keep, weights=phi)
    if beta:  # TRL's kl metric: the k3 times the ratio (use_bias_correction_kl), its mean over the completion tokens
        # (the plain k3 had been logged: 43% under TRL's per token, 35% per sequence, audit 6)
        assert kl.mean().item() == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-5)
    ours = (loss * token_weights(completion, lengths, loss_type)).sum() / loss_units(
        lengths, loss_type, max_completion_tokens=MAX_COMPLETION)
    ours.backward()
    # vespo: each token's whole loss (about -4.6 a log-probability here) scaled by phi, exp of k x its completion's
    # summed log-ratios: the two sides' old log-probabilities, 1e-7 apart by their forwards' rounding, move it 1e-6
    assert ours.item() == (pytest.approx(theirs.item(), rel=5e-6) if loss_type == "vespo" else
                           pytest.approx(theirs.item(), abs=1e-6))
    if loss_type == "vespo":  # the weights moved off 1, each completion's its own
        per_completion = torch.zeros(len(COMPLETIONS)).index_add(0, completion, phi / lengths.float()[completion])
        # rel 5e-6: phi is exp of k x a sum of log-ratios (measured 1.1e-6 apart: the float32 sums' order)
        assert per_completion.mean().item() == pytest.approx(trainer._metrics["train"]["vespo/phi_seq_mean"][-1],
                                                             rel=5e-6)
        assert len({round(x, 4) for x in per_completion.tolist()}) == len(COMPLETIONS) and (phi - 1).abs().max() > 1e-3
    elif loss_type == "sapo":  # the gate is not PPO's clip: grpo's loss on the same tokens is another
        plain, _, _ = token_losses(logps.detach(), advantages[completion], old_logps=old, ref_logps=ref, epsilon=0.2,
                                   beta=beta)
        assert (plain - loss.detach()).abs().max().item() > 1e-4 and not clipped.any()
        assert "clip_ratio/region_mean" not in trainer._metrics["train"]
    elif delta is None:
        assert 0 < clipped.sum() < len(clipped)  # the clip binds on some tokens, not all
    else:  # the cap binds: without it the loss is another
        uncapped, _, _ = token_losses(logps.detach(), advantages[completion], old_logps=old, ref_logps=ref,
                                      epsilon=0.2, beta=beta)
        assert abs((uncapped - loss.detach()).abs().max().item()) > 1e-3
    share = 1.0 / lengths.float()[completion]  # a completion's clipped share (sequence), else a token's
    clip = (clipped * share).sum() / share.sum() if level == "sequence" else clipped.float().mean()
    metric = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"
    if loss_type not in ("sapo", "vespo"):
        assert clip.item() == pytest.approx(trainer._metrics["train"][metric][-1])
    # TRL's entropy metric: the policy's mean entropy over the completion tokens
    assert entropy.mean().item() == pytest.approx(trainer._metrics["train"]["entropy"][-1], abs=1e-5)
    assert 0 < entropy.mean().item() < torch.log(torch.tensor(float(ours_model.config.vocab_size))).item()
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(ours_model.parameters(), theirs_model.parameters()))
    assert worst < 1e-6, worst


@pytest.mark.parametrize("loss_type, beta, quantile", [("dapo", 0.0, 0.2), ("grpo", 0.04, 0.5), ("dr_grpo", 0.0, 0.0),
                                                      ("dapo", 0.04, 0.2)])
def test_top_entropy_quantile_equals_trls(tiny_assets, tmp_path, loss_type, beta, quantile):
    """rl.top_entropy_quantile (TRL's, "Beyond the 80/20 Rule"): only the tokens whose entropy is in the top share of
    the pass's trained tokens train their policy term; the KL term counts for every token. Against TRL's
    _compute_loss with its top_entropy_quantile (its get_high_entropy_mask over the micro-batch): the same loss and
    gradients to 1e-6, with 4 of the 11 tokens kept at 0.2 (two tied), 6 at 0.5, the highest alone at 0; not the
    loss of every token."""
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.data.formats import IGNORE
    from llmtrain.model.loss import attach_loss, compute_loss
    from llmtrain.objectives.grpo import high_entropy_keep

    prompts = [[1] + PROMPTS[i // 2] for i in range(4)]
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2])
    theirs_model, ours_model, reference = two_copies_and_a_moved_one(tiny_assets, 0.01)
    trainer = trl_trainer(theirs_model, tiny_assets, tmp_path, loss_type=loss_type, beta=beta)
    trainer.top_entropy_quantile = quantile
    inputs = padded_inputs(prompts, COMPLETIONS, advantages, pad=trainer.processing_class.pad_token_id)
    if beta:
        with_trl_reference(trainer, inputs, reference)
    theirs = trainer._compute_loss(theirs_model, inputs)
    theirs.backward()

    sequences = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompts, COMPLETIONS)]
    batch = with_loss_positions(collate(sequences, pad_id=0, packing=True))
    for model in (ours_model, reference):
        attach_loss(model, chunk=4096)
    with torch.no_grad():
        ref = -compute_loss(reference.eval(), batch, per_token=True).float() if beta else None
    losses, entropy = compute_loss(ours_model, batch, per_token=True, stat="entropy")
    logps = -losses.float()
    completion = batch["loss_example"]
    lengths = torch.bincount(completion, minlength=len(COMPLETIONS))
    keep = high_entropy_keep(entropy, quantile)
    # the first tokens of a prompt's two completions share their context, so their entropies tie
    assert int(keep.sum()) == {0.2: 4, 0.5: 6, 0.0: 1}[quantile]
    assert entropy[keep.bool()].min() >= entropy[~keep.bool()].max()
    units = loss_units(lengths, loss_type, max_completion_tokens=MAX_COMPLETION)
    weights = token_weights(completion, lengths, loss_type)
    loss, _, _ = token_losses(logps, advantages[completion], ref_logps=ref, epsilon=0.2, beta=beta, keep=keep)
    ours = (loss * weights).sum() / units
    every, _, _ = token_losses(logps.detach(), advantages[completion], ref_logps=ref, epsilon=0.2, beta=beta)
    assert abs((every * weights).sum().item() / units - ours.item()) > 1e-4  # the mask binds
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(ours_model.parameters(), theirs_model.parameters()))
    assert worst < 1e-6, worst


def test_the_entropy_threshold_is_torch_quantiles():
    """high_entropy_keep takes the quantile as torch.quantile does (TRL's call), by sorting, so it has no limit of
    2^24 values: the same tokens kept for 1 to 4,097 values and every share."""
    from llmtrain.objectives.grpo import high_entropy_keep

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 11, 100, 4097):
        for quantile in (0.0, 0.1, 0.2, 0.5, 0.77, 1.0):
            entropy = torch.rand(n, generator=g) * 5
            assert torch.equal(high_entropy_keep(entropy, quantile),
                               (entropy >= torch.quantile(entropy, 1 - quantile)).float()), (n, quantile)


def test_top_entropy_quantile_pools_every_process_and_skips_stand_ins():
    """The quantile is over the pass's tokens on every process (`gather` concatenates their lists), so 2 processes
    of half the tokens each keep what one process of them all keeps; a stand-in pass's tokens join no quantile (its
    process still gathers); nothing pooled keeps nothing."""
    from llmtrain.objectives.grpo import high_entropy_keep

    entropy = torch.tensor([3.0, 2.5, 0.5, 1.0, 0.1, 2.0, 1.5, 0.7])
    whole = high_entropy_keep(entropy, 0.25)  # the 0.75 quantile of all 8: 2.125
    assert whole.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    first, second = entropy[:4], entropy[4:]
    both = lambda mine: first.tolist() + second.tolist()  # noqa: E731 -- what each process's gather returns
    assert torch.cat([high_entropy_keep(first, 0.25, gather=both),
                      high_entropy_keep(second, 0.25, gather=both)]).tolist() == whole.tolist()
    # each process's own quantile would keep another set: the first's top one, the second's top one
    assert torch.cat([high_entropy_keep(first, 0.25), high_entropy_keep(second, 0.25)]).tolist() == [
        1, 0, 0, 0, 0, 1, 0, 0]
    seen = []
    high_entropy_keep(first, 0.25, gather=lambda mine: seen.append(mine) or second.tolist(), counts=False)
    assert seen == [[]]
    assert high_entropy_keep(first, 0.5, gather=lambda mine: []).sum() == 0


def grpo_objective(model, **rl):
    """llmtrain's GRPO objective on `model` (its loss patched in), for a batch built as its rollout builds one."""
    from llmtrain.config import RLConfig
    from llmtrain.model.loss import attach_loss
    from llmtrain.objectives.grpo import GRPO

    attach_loss(model, chunk=4096)
    config = RLConfig(rewards=[{"type": "format", "pattern": "x"}], max_completion_tokens=MAX_COMPLETION, **rl)
    return GRPO(config, tokenizer=None, pad_id=0, packing=True, seed=0, rewards=[("format", lambda **_: [], 1.0)],
                model=model, columns=["input_ids", "row", "prompt"], stop_ids=[2], world=1)


def rollout_batch(grpo, prompts, completions, advantages) -> tuple[dict, float, float]:
    """(the pass's batch as GRPO's rollout leaves it, the window's loss units, its trained tokens)."""
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.data.formats import IGNORE

    sequences = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompts, completions)]
    batch = with_loss_positions(collate(sequences, pad_id=0, packing=True))
    lengths = torch.bincount(batch["loss_example"], minlength=len(completions))
    grpo._attach(batch, advantages, lengths)
    batch["rollout_stats"] = torch.zeros(len(grpo.stats) - len(grpo.loss_stats))
    return batch, grpo._loss_units(lengths), float(lengths.sum())


@pytest.mark.parametrize("loss_type, coef, adaptive", [("dapo", 0.1, False), ("grpo", 0.3, False),
                                                        ("dr_grpo", -0.2, False), ("dapo", 0.05, True)])
def test_the_entropy_bonus_equals_trls(tiny_assets, tmp_path, loss_type, coef, adaptive):
    """rl.entropy_coef (TRL's entropy_coef): the loss minus coef x the mean entropy of the trained tokens, with its
    gradient (TRL's fused head differentiates the entropy too). Through GRPO.loss as the step runs it (the window's
    units per trained token in the batch, the sum divided by the units): TRL's _compute_loss's loss and gradients to
    1e-6, for each normalisation; not the loss without the bonus (the gradients part by more than 1e-4). Adaptive
    (rl.use_adaptive_entropy): with the last step's entropy under the target both apply the coefficient, and both
    controllers move it the same way after the step."""
    prompts = [[1] + PROMPTS[i // 2] for i in range(4)]
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2])
    theirs_model, ours_model, plain_model = (tiny_model(tiny_assets) for _ in range(3))
    trainer = trl_trainer(theirs_model, tiny_assets, tmp_path, loss_type=loss_type, beta=0.0)
    trainer.entropy_coef, trainer._entropy_bonus_enabled = coef, True
    adaptive_keys = dict(use_adaptive_entropy=True, entropy_target=9.0, entropy_coef_delta=0.01) if adaptive else {}
    if adaptive:
        trainer.use_adaptive_entropy, trainer._last_world_entropy = True, 5.0
        trainer.args.entropy_target, trainer.args.entropy_coef_delta = 9.0, 0.01
    inputs = padded_inputs(prompts, COMPLETIONS, advantages, pad=trainer.processing_class.pad_token_id)
    theirs = trainer._compute_loss(theirs_model, inputs)
    theirs.backward()

    grpo = grpo_objective(ours_model, loss_type=loss_type, entropy_coef=coef, **adaptive_keys)
    if adaptive:
        grpo.entropy.seen = 5.0  # the last step's entropy, under the target: applied
    batch, units, trained = rollout_batch(grpo, prompts, COMPLETIONS, advantages)
    batch["units_per_trained"] = units / trained
    total, stats = grpo.loss(ours_model, batch)
    ours = total / units
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(ours_model.parameters(), theirs_model.parameters()))
    assert worst < 1e-6, worst
    plain = grpo_objective(plain_model, loss_type=loss_type)
    plain_batch, _, _ = rollout_batch(plain, prompts, COMPLETIONS, advantages)
    (plain.loss(plain_model, plain_batch)[0] / units).backward()
    assert max((p.grad - q.grad).abs().max().item()
               for p, q in zip(ours_model.parameters(), plain_model.parameters())) > 1e-4  # the bonus moves it
    line = grpo.step_metrics(stats.tolist(), units)
    assert line["policy_loss"] == pytest.approx(ours.item() + coef * line["entropy"], abs=1e-6)
    if adaptive:
        grpo.after_window(stats.tolist())  # entropy ~4.8 nats, under the target 9: raised by the delta
        assert grpo.entropy.coef == pytest.approx(trainer.entropy_coef) == pytest.approx(coef + 0.01)
        assert grpo.entropy.seen == pytest.approx(trainer._last_world_entropy, abs=1e-6)


def test_adaptive_entropy_control_moves_the_coefficient_within_its_bounds_and_gates_it():
    """TRL's controller: applied only after a step whose mean entropy was at or below the target (never at the
    first step), raised by the delta after such a step and lowered after any other, within [min, max]."""
    from llmtrain.config import RLConfig
    from llmtrain.objectives.grpo import EntropyControl

    rl = RLConfig(rewards=[{"type": "format", "pattern": "x"}], use_adaptive_entropy=True, entropy_coef=0.02,
                  entropy_target=1.0, entropy_coef_delta=0.01, entropy_coef_max=0.035)
    control = EntropyControl(rl)
    applied = []
    for entropy in (2.0, 0.5, 0.5, 0.5, 1.0, 3.0, 3.0, 3.0, 3.0):
        applied.append(control.applied())
        control.update(entropy)
    assert applied == pytest.approx([0.0, 0.0, 0.02, 0.03, 0.035, 0.035, 0.0, 0.0, 0.0])
    assert control.coef == 0.0  # lowered to entropy_coef_min, 0
    restored = EntropyControl(rl)
    restored.load_state_dict(control.state_dict())
    assert (restored.coef, restored.seen, restored.applied()) == (0.0, 3.0, 0.0)
    fixed = EntropyControl(RLConfig(rewards=[{"type": "format", "pattern": "x"}], entropy_coef=0.1))
    fixed.update(0.0)
    assert fixed.applied() == 0.1  # without the controller: always the coefficient


@pytest.mark.parametrize("keys, says", [
    ({"entropy_target": 0.5}, "rl.entropy_target is read by adaptive entropy control, which is off"),
    ({"entropy_coef": 0.1, "top_entropy_quantile": 0.2}, "known only pass by pass"),
    ({"algorithm": "rloo", "entropy_coef": 0.1}, "rl.entropy_coef is read by rl.algorithm: grpo"),
    ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "swap them")])
def test_entropy_bonus_settings_a_run_cannot_use_are_refused(keys, says):
    from llmtrain.config import RLConfig

    with pytest.raises(ValueError, match=says):
        RLConfig(rewards=[{"type": "format", "pattern": "x"}], **keys)


def test_a_cispo_cap_below_one_is_refused():
    """CISPO's epsilon_high is the cap of the ratio itself: DAPO's 0.28 copied over capped the ratio of 1 of every
    first update, scaling every gradient by 0.28 (a third of the tokens logged as clipped at ratio 1), with no word."""
    from llmtrain.config import RLConfig

    with pytest.raises(ValueError, match="0.28 caps the ratio of 1 every first update has, so every token's gradient "
                                         "is scaled by 0.28. Give a cap of 1 or more"):
        RLConfig(rewards=[{"type": "format", "pattern": "x"}], loss_type="cispo", epsilon_high=0.28)
    assert RLConfig(rewards=[{"type": "format", "pattern": "x"}], loss_type="cispo", epsilon_high=1.0).epsilon_high == 1


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_masked_truncated_completions_train_nothing_and_normalise_as_trls(tiny_assets, tmp_path, loss_type):
    """rl.mask_truncated_completions: the last completion reached max_completion_tokens without EOS; its tokens train
    nothing (TRL zeroes its completion_mask, and num_items_in_batch counts the rest), while grpo and dr_grpo still
    divide by every completion. The same loss and gradients as TRL's _compute_loss to 1e-6."""
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.model.loss import attach_loss, compute_loss
    from llmtrain.objectives.rollouts import completion_rows

    prompts = [[1] + PROMPTS[i // 2] for i in range(4)]
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2])
    theirs_model, ours_model = tiny_model(tiny_assets), tiny_model(tiny_assets)
    trainer = trl_trainer(theirs_model, tiny_assets, tmp_path, loss_type=loss_type, beta=0.0)
    inputs = padded_inputs(prompts, COMPLETIONS, advantages, pad=trainer.processing_class.pad_token_id)
    inputs["completion_mask"][3] = 0  # COMPLETIONS[3] has no EOS: truncated
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    theirs = trainer._compute_loss(theirs_model, inputs)
    theirs.backward()

    masks = [[1] * len(c) for c in COMPLETIONS[:3]] + [[0] * len(COMPLETIONS[3])]
    batch = with_loss_positions(collate(completion_rows(prompts, COMPLETIONS, masks=masks), pad_id=0, packing=True))
    attach_loss(ours_model, chunk=4096)
    logps = -compute_loss(ours_model, batch, per_token=True).float()
    completion = batch["loss_example"]
    lengths = torch.bincount(completion, minlength=len(COMPLETIONS))
    assert lengths.tolist() == [3, 2, 5, 0]
    loss, _, _ = token_losses(logps, advantages[completion], epsilon=0.2)
    ours = (loss * token_weights(completion, lengths, loss_type)).sum() / loss_units(
        lengths, loss_type, max_completion_tokens=MAX_COMPLETION)
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(ours_model.parameters(), theirs_model.parameters()))
    assert worst < 1e-6, worst


def test_advantages_equal_trls_for_group_and_none_scaling():
    """TRL's arithmetic (trl/trainer/grpo_trainer.py, sum_then_normalize), written out here with its own nanstd:
    a group with spread rewards, a group whose rewards are all equal (std 0: advantages 0), and a reward of None
    (NaN: left out of its group's mean and std, advantage 0)."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, float("nan"), 1.0, 3.0])
    for scale in ("group", "none"):
        mean = torch.nanmean(rewards.view(-1, 2), dim=1).repeat_interleave(2)
        std = nanstd(rewards.view(-1, 2), dim=1).repeat_interleave(2)
        theirs = rewards - mean
        if scale != "none":
            theirs = theirs / (std + 1e-4)
        theirs = torch.nan_to_num(theirs, nan=0.0)
        ours, our_std = group_advantages(rewards, 2, scale_rewards=scale)
        assert torch.allclose(ours, theirs, atol=1e-7, equal_nan=False), (scale, ours, theirs)
        assert torch.equal(our_std.isnan(), std.isnan())
    ours, std = group_advantages(rewards, 2, scale_rewards="group")
    assert ours[2:4].tolist() == [0.0, 0.0] and std[2].item() == 0.0  # equal rewards teach nothing
    assert ours[4].item() == 0.0 and ours[5].item() == 0.0  # a lone scored reward in its group: std NaN -> 0


def test_batch_scaled_advantages_equal_trls():
    """scale_rewards batch (TRL's, PPO Lite): reward minus its group's mean, divided by the std of every reward of
    the step (its nanstd, a None left out) + 1e-4: TRL's arithmetic against group_advantages then batch_moments (the
    loop divides the rollout's advantages by it once every process's rewards are gathered)."""
    from trl.trainer.utils import nanstd

    from llmtrain.objectives.grpo import batch_moments

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, float("nan"), 1.0, 3.0])
    mean = torch.nanmean(rewards.view(-1, 2), dim=1).repeat_interleave(2)
    theirs = torch.nan_to_num((rewards - mean) / (nanstd(rewards).expand_as(rewards) + 1e-4), nan=0.0)
    centred, _ = group_advantages(rewards, 2, scale_rewards="batch")
    ours = centred / batch_moments([None if r != r else r for r in rewards.tolist()])[1]
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    assert ours[2:4].tolist() == [0.0, 0.0] and ours[5].item() == 0.0
    assert batch_moments([1.0, None]) == pytest.approx((1.0, 1e-4))  # one scored reward: no spread, as TRL's 0


def test_normalize_then_sum_advantages_equal_trls():
    """multi_objective_aggregation normalize_then_sum (GDPO, TRL's): TRL's arithmetic written out with its own
    nanstd, against normalized_then_summed then batch_moments (the loop takes the moments over every process's
    completions): a function's None left out of its group's moments, a completion no function scored (advantage 0), a
    group where one function is flat, weights 1 and 2."""
    from trl.trainer.utils import nanstd

    from llmtrain.objectives.grpo import batch_moments, normalized_then_summed

    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 1.0], [0.5, 0.0], [2.0, nan], [1.0, 3.0],
                                 [nan, nan], [3.0, 2.0]])
    weights = torch.tensor([1.0, 2.0])
    grouped = per_function.view(-1, 2, 2)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, 2) * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = nan
    theirs = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4),
                              nan=0.0)
    summed = normalized_then_summed(per_function, [1.0, 2.0], 2)
    shift, divisor = batch_moments([None if v != v else v for v in summed.tolist()])
    ours = torch.nan_to_num((summed - shift) / divisor, nan=0.0)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    assert ours[6].item() == 0.0 and ours.abs().max() > 0.5


def test_ratio_is_one_and_clipping_counts_only_where_it_binds():
    logps = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    loss, kl, clipped = token_losses(logps, torch.tensor([1.0, -1.0, 2.0]), epsilon=0.2)
    assert kl is None and not clipped.any()
    assert loss.tolist() == [-1.0, 1.0, -2.0]  # -ratio x advantage with ratio 1
    loss.sum().backward()
    assert logps.grad.tolist() == [-1.0, 1.0, -2.0]  # d(-A exp(l - l.detach()))/dl = -A
    old = torch.tensor([-1.5, -1.5, -0.5])  # ratios e^0.5 (A > 0: clipped at 1.2), e^-0.5 (A < 0: clipped at 0.8)
    _, _, clipped = token_losses(logps.detach(), torch.tensor([1.0, -1.0, 2.0]), old_logps=old, epsilon=0.2)
    assert clipped.tolist() == [True, True, False]


# --------------------------------------------------------------------------- rewards


def test_built_in_rewards_and_a_trl_style_function_unchanged(tmp_path, monkeypatch):
    """answer_match extracts as eval_answer_accuracy does (None where the reference has no answer); format
    searches a pattern; a function written for TRL's GRPOTrainer (prompts, completions, **columns) runs as it is,
    imported by module:function; the weighted sum leaves out None and is NaN where nothing applied."""
    from llmtrain.objectives.rewards import answer_match, format_match, import_reward, score

    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, **kwargs):\n"
        "    assert set(kwargs) == {'answer', 'completion_ids', 'trainer_state', 'log_extra', 'log_metric'}\n"
        "    return [1.0 if len(c) < 12 else None for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    completions = ["so 7\n#### 7", "#### 8", "no answer at all here", "<think>x</think> #### 5"]
    columns = {"answer": ["#### 7", "#### 7", "#### 7", "no number"]}
    functions = [("answer_match", answer_match(r"#### (\S+)"), 1.0),
                 ("format", format_match(r"<think>.*</think>"), 0.5),
                 ("my_rewards:short", import_reward("my_rewards:short"), 2.0)]
    per_function, total = score(functions, ["q"] * 4, completions, completion_ids=[[1]] * 4, columns=columns,
                                rows=[1, 1, 2, 2], where="d.jsonl")
    assert per_function[:, 0].tolist()[:3] == [1.0, 0.0, 0.0] and per_function[3, 0].isnan()
    assert per_function[:, 1].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert per_function[0, 2].item() == 1.0 and per_function[2, 2].isnan()
    assert total.tolist() == [3.0, 2.0, 0.0, 0.5]
    _, nothing = score([functions[2]], ["q"], ["a much longer completion"], completion_ids=[[1]],
                       columns={"answer": ["x"]}, rows=[3], where="d.jsonl")
    assert nothing.isnan().all()  # no function applied: left out of its group, advantage 0


@pytest.mark.parametrize("body, says", [
    ("raise KeyError('answer')",
     "reward function bad raised KeyError: 'answer' (on the completions of d.jsonl, rows 4, 9)"),
    ("return [1.0]", "reward function bad returned 1 value for 2 completions (d.jsonl, rows 4, 9)"),
    ("return [1.0, float('nan')]", "reward function bad returned nan for the completion of row 9 of d.jsonl"),
    ("return ['1', 0.0]", "reward function bad returned '1' for the completion of row 4 of d.jsonl"),
    ("return 1.0", "reward function bad returned float for 2 completions (d.jsonl, rows 4, 9)"),
])
def test_a_bad_reward_function_stops_with_its_name_and_row(body, says):
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import score

    namespace: dict = {}
    exec(f"def bad(prompts, completions, **columns):\n    {body}\n", namespace)
    with pytest.raises(LLMTrainError, match=re.escape(says)):
        score([("bad", namespace["bad"], 1.0)], ["p", "p"], ["a", "b"], completion_ids=[[1], [2]], columns={},
              rows=[4, 9], where="d.jsonl")


def test_a_reward_module_that_fails_to_import_says_whether_it_was_found(tmp_path, monkeypatch):
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import import_reward

    (tmp_path / "broken_rewards.py").write_text("def r(prompts completions):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LLMTrainError, match=r"importing broken_rewards failed: SyntaxError: .* The module was found; "
                                            r"fix the error in it \(python -c 'import broken_rewards' shows"):
        import_reward("broken_rewards:r")
    with pytest.raises(LLMTrainError, match=r"No module named 'absent_rewards'\. Put the module on PYTHONPATH"):
        import_reward("absent_rewards:r")


def test_a_reward_named_by_its_file_is_told_to_name_its_module(tmp_path, monkeypatch):
    """`badr.py:good` and `./badr.py:good` had been told to put the module in the working directory, where it was,
    and that "the module was found; fix the error in it" (python -c 'import ./badr.py'): the fix is its module's
    name. rl.tools' and rl.environment's names alike."""
    from llmtrain.data.tools import function_of
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import import_reward

    monkeypatch.chdir(tmp_path)
    (tmp_path / "badr.py").write_text("def good(completions, **kw):\n    return [0.0] * len(completions)\n")
    for spec in ("badr.py:good", "./badr.py:good"):
        with pytest.raises(LLMTrainError, match=re.escape(f"reward function '{spec}' names a file; name its module "
                                                          "instead: 'badr:good', with the working directory")):
            import_reward(spec)
    with pytest.raises(LLMTrainError, match=re.escape("the tool 'tools/calc.py:add' names a file; name its module "
                                                      "instead: 'calc:add', with tools on PYTHONPATH")):
        function_of("tools/calc.py:add")
    assert import_reward("badr:good")(completions=["x"]) == [0.0]


def test_a_reward_function_that_raises_or_exits_is_named_at_its_own_line(tmp_path, monkeypatch):
    """The paragraph names the function's file and line where it raised (the user's frame), and the exception stays
    its cause, so that --debug's traceback goes on into the function (`from None` had cut it off); sys.exit() in one
    (not an Exception) had ended the run with no word."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import import_reward, score

    (tmp_path / "raising_rewards.py").write_text("def helper(x):\n    return {}[x]\n\n\ndef raises(completions, **kw):"
                                                 "\n    return [helper('answer') for c in completions]\n\n\n"
                                                 "def exits(completions, **kw):\n    import sys\n    sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, says, cause in (("raises", "raised KeyError: 'answer' at raising_rewards.py:2 in helper (on the "
                               "completions of d.jsonl, rows 4). Fix the function (--debug shows its traceback)",
                               KeyError),
                              ("exits", "raised SystemExit: 3 at raising_rewards.py:11 in exits (on the", SystemExit)):
        with pytest.raises(LLMTrainError) as e:
            score([(name, import_reward(f"raising_rewards:{name}"), 1.0)], ["p"], ["a"], completion_ids=[[1]],
                  columns={}, rows=[4], where="d.jsonl")
        assert f"reward function {name} {says}" in str(e.value) and isinstance(e.value.__cause__, cause)


def test_a_reward_function_that_takes_no_keywords_is_told_what_it_is_called_with():
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import score

    def brevity(completion):  # one positional argument: TRL's keywords do not reach it
        return [1.0]

    with pytest.raises(LLMTrainError, match=r"unexpected keyword argument 'prompts'.*It is called with keyword "
                                            r"arguments, as TRL calls it: prompts, completions, completion_ids, "
                                            r"trainer_state, log_extra, log_metric and each column"):
        score([("brevity", brevity, 1.0)], ["p"], ["a"], completion_ids=[[1]], columns={}, rows=[1], where="d.jsonl")


@pytest.mark.parametrize("signature, missing", [
    ("prompts, completions, solution, **kwargs", "solution"),
    ("completions, *, solution", "solution"),
    ("x, /, completions, **kwargs", "x"),  # TRL passes keywords only: a positional-only argument never arrives
])
def test_a_reward_function_asking_for_a_missing_column_is_refused_with_the_columns(signature, missing):
    """Not Python's `TypeError ... missing 1 required positional argument: 'solution'`: the function, the argument,
    the columns the data has and what to change."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import check_rewards

    namespace: dict = {}
    exec(f"def needs({signature}):\n    return [1.0] * len(completions)\n", namespace)
    rows = [{"prompt": "2+2=", "row": 0, "input_ids": [5, 6], "user/answer": "4", "user/level": 1}]
    with pytest.raises(LLMTrainError) as e:
        check_rewards([("mine:needs", namespace["needs"], 1.0)], rows, where="d.jsonl")
    says = str(e.value)
    assert f"reward function mine:needs needs the argument '{missing}'" in says
    assert "each column of d.jsonl but the prompt (which is `prompts`) by its name: ['answer', 'level']" in says
    assert f"Rename the data's column to '{missing}'" in says and "\n" not in says
    assert "TypeError" not in says


def test_a_reward_function_with_defaults_or_kwargs_for_what_is_absent_passes_the_check():
    from llmtrain.objectives.rewards import check_rewards

    def fine(prompts, completions, answer, solution=None, *args, **kwargs):
        return [1.0] * len(completions)

    rows = [{"prompt": "2+2=", "row": 0, "input_ids": [5, 6], "user/answer": "4"}]
    check_rewards([("fine", fine, 1.0)], rows, where="d.jsonl")


def test_log_metric_numbers_are_averaged_over_every_process_not_the_main_ones_alone():
    """Two processes' log_metric calls since the last line: the line has each name's mean over all the numbers (as
    one process logging them all would), a name only the other process logged included; the objective's own
    metrics are never overwritten."""
    from llmtrain.config import RLConfig
    from llmtrain.objectives.grpo import GRPO
    from llmtrain.objectives.rewards import RewardLogs, metric_means

    other = RewardLogs()  # what the second process logged
    for value in (30.0, 50.0):
        other.log_metric("chars", value)
    other.log_metric("only_there", 5)
    other.log_metric("reward", 99.0)
    gathered = []

    def gather(mine: list) -> list:  # collectives.gathered: every rank's list, in rank order
        gathered.append(mine)
        return mine + other.metric_sums()

    rl = RLConfig(rewards=[{"type": "format", "pattern": "x"}])
    grpo = GRPO(rl, tokenizer=None, pad_id=0, packing=True, seed=0, rewards=[("format", lambda **_: [], 1.0)],
                model=None, columns=["input_ids", "row", "prompt"], stop_ids=[], world=2, gather=gather)
    grpo.logs.log_metric("chars", 10.0)
    grpo.logs.log_metric("chars", 20.0)
    line = grpo.step_metrics([1.0] * len(grpo.stats), 1.0)
    assert gathered == [[("chars", 30.0, 2)]]
    assert line["chars"] == pytest.approx(27.5) and line["only_there"] == 5.0  # (10 + 20 + 30 + 50) / 4
    assert line["reward"] == 1.0  # the objective's own
    assert grpo.step_metrics([1.0] * len(grpo.stats), 1.0)["chars"] == pytest.approx(40.0)  # ours were cleared
    assert metric_means([]) == {}


# TRL 1.16's documented reward functions (docs/source/grpo_trainer.md, "Using a custom reward function"), as
# printed there, and one per form the trainer accepts (trainer_state, a numpy array, a tensor). Example 1 is printed
# with `completions_ids`, a name the trainer never passes (it passes `completion_ids`), so it fails under TRL too;
# it is here with the trainer's name.
TRL_DOCS_REWARDS = r"""
import asyncio
import re

import numpy as np
import torch


def reward_func(completion_ids, **kwargs):
    '''Reward function that assigns higher scores to longer completions (in terms of token count).'''
    return [float(len(ids)) for ids in completion_ids]


def reward_chars(completions, **kwargs):
    '''Reward function that assigns higher scores to longer completions (in terms of character count).'''
    return [float(len(completion)) for completion in completions]


def reward_boxed(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def check_math_solution(prompt, completion):  # the docs leave these two to the reader
    return "4" in completion


def test_code_solution(prompt, completion):
    return "def" in completion


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


def curriculum(completions, trainer_state, **kwargs):
    # dynamic reward shaping on the trainer's state, as TRL's GRPOTrainer docstring describes it
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress * len(c) for c in completions]


def as_numpy(completions, **kwargs):
    return np.array([len(c) / 10 for c in completions])


def as_tensor(completions, **kwargs):
    return torch.tensor([float("x" in c) for c in completions])


def logs(completions, log_extra, log_metric, **kwargs):
    log_extra("first_char", [c[:1] for c in completions])
    log_metric("chars", sum(map(len, completions)))
    return [0.0] * len(completions)
"""
TRL_DOCS_NAMES = ["reward_func", "reward_chars", "reward_boxed", "math_reward_func", "async_reward_func", "curriculum",
                  "as_numpy", "as_tensor", "logs"]


def trls_rewards(functions, state, *, prompts, completions, completion_ids, columns):
    """TRL 1.16's own GRPOTrainer._calculate_rewards on a stand-in trainer: what TRL makes of the functions."""
    from types import SimpleNamespace

    from trl import GRPOTrainer
    from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    thread, loop, ready = start_event_loop_in_daemon()
    ready.wait()
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True), args=SimpleNamespace(
            report_to=[]), reward_funcs=functions, reward_processing_classes=[None] * len(functions),
        reward_func_names=[f.__name__ for f in functions], state=state, environments=None, async_loop=loop,
        _log_completion_extra=lambda column, values: None, _log_metric=lambda name, value: None)
    inputs = [{"prompt": p, **{c: v[i] for c, v in columns.items()}} for i, p in enumerate(prompts)]
    try:
        return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)
    finally:
        shutdown_event_loop_in_daemon(thread, loop)


def test_trls_documented_reward_functions_run_unchanged_and_score_as_trl_scores_them(tmp_path, monkeypatch):
    """TRL's example reward functions, imported as a user's module: sync and async, with completion_ids,
    trainer_state, the data's columns by name, None for the rows a function does not apply to, numpy and tensor
    results, log_extra and log_metric. Every reward equals what TRL 1.16's own _calculate_rewards makes of them."""
    from transformers import TrainerState

    from llmtrain.objectives.rewards import RewardLogs, import_reward, score

    (tmp_path / "trl_docs_rewards.py").write_text(TRL_DOCS_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = [import_reward(f"trl_docs_rewards:{name}") for name in TRL_DOCS_NAMES]
    prompts = ["What is 2+2?", "Write a function that returns the sum.", "Solve 2x = 4.", "What is 3*4?"]
    completions = [r" 4, so \boxed{4}", " def add(a, b): return a + b", r" x = \boxed{2}", ""]
    completion_ids = [[7, 8, 9], [10, 11], [12], []]
    columns = {"ground_truth": ["4", "x", "3", "12"], "task": ["math", "code", "math", "math"]}
    state = TrainerState(global_step=3, max_steps=12)
    logs = RewardLogs()
    ours, _ = score([(n, f, 1.0) for n, f in zip(TRL_DOCS_NAMES, functions)], prompts, completions,
                    completion_ids=completion_ids, columns=columns, rows=[1, 2, 3, 4], where="d.jsonl", state=state,
                    logs=logs)
    theirs = trls_rewards(functions, state, prompts=prompts, completions=completions, completion_ids=completion_ids,
                          columns=columns)
    torch.testing.assert_close(ours.float(), theirs, equal_nan=True)
    assert ours[:, 0].tolist() == [3.0, 2.0, 1.0, 0.0]  # completion_ids
    assert ours[:, 3].isnan().tolist() == [False, True, False, False]  # None: not a math task
    assert ours[:, 4].tolist() == [1.0, 1.0, 1.0, 0.0]  # async, awaited
    assert ours[:, 5].tolist() == pytest.approx([0.25 * len(c) for c in completions])  # trainer_state
    assert logs.extra == {"first_char": [" ", " ", " ", ""]} and logs.metrics == {"chars": [sum(map(len, completions))]}


def test_async_reward_functions_share_one_event_loop_and_run_inside_a_running_one():
    """As TRL keeps one event loop for the run: what an async function keeps from its first call (here the loop
    itself; in practice an HTTP client bound to it) is valid at the next; and scoring from code that is itself
    inside an event loop (a notebook) works."""
    import asyncio

    from llmtrain.objectives.rewards import AsyncRunner, score

    loops = []

    async def judge(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def scored(runner):
        return score([("judge", judge, 1.0)], ["p"], ["c"], completion_ids=[[1]], columns={}, rows=[1], where="d",
                     runner=runner)[1].tolist()

    with AsyncRunner() as runner:
        assert scored(runner) == scored(runner) == [1.0]

        async def inside_a_loop():
            return scored(runner)

        assert asyncio.run(inside_a_loop()) == [1.0]
    assert loops[0] is loops[1] is loops[2]
    assert scored(None) == [1.0] and loops[3] is not loops[0]  # no runner: a loop of its own


def test_a_reward_function_that_cannot_be_imported_says_what_is_missing():
    from llmtrain.errors import LLMTrainError
    from llmtrain.objectives.rewards import import_reward

    with pytest.raises(LLMTrainError, match="not of the form module:function"):
        import_reward("no_colon")
    with pytest.raises(LLMTrainError, match="importing no_such_module_here failed: ModuleNotFoundError"):
        import_reward("no_such_module_here:f")
    with pytest.raises(LLMTrainError, match="math has no function nope"):
        import_reward("math:nope")


def test_a_reward_function_or_tool_beside_the_recipe_is_found_by_the_llmtrain_command(tmp_path, monkeypatch):
    """The `llmtrain` console script has its bin folder on sys.path, not the working directory (`python -m`'s): a
    rewards module next to the recipe, run from there, was "No module named" with the advice to put it next to where
    llmtrain runs, where it was."""
    import sys

    from llmtrain.data.tools import function_of
    from llmtrain.objectives.rewards import import_reward

    (tmp_path / "beside_the_recipe.py").write_text("def shorter(prompts, completions, **kw):\n"
                                                   "    return [-len(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as the console script's
    monkeypatch.delitem(sys.modules, "beside_the_recipe", raising=False)
    assert import_reward("beside_the_recipe:shorter")([""], ["ab", "c"]) == [-2, -1]
    assert function_of("beside_the_recipe:shorter") is import_reward("beside_the_recipe:shorter")
    assert sys.path[-1] == str(tmp_path)  # last: a file of the user's never shadows an installed package


# --------------------------------------------------------------------------- sampling completions


@pytest.fixture(scope="module")
def lm(tiny_assets):
    return tiny_model(tiny_assets).eval()


def test_greedy_sampling_equals_transformers_generate(lm):
    from llmtrain.model.generate import sample

    prompt = [1, 5, 9, 12, 7, 30]
    theirs = lm.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=8, do_sample=False, temperature=None, top_p=None, top_k=None,
                         eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
    ours = sample(lm, [prompt], seeds=[0], max_new_tokens=8, temperature=0.0, top_p=1.0, stop_ids={2}, pad_id=0)
    assert ours == [theirs[: theirs.index(2) + 1] if 2 in theirs else theirs]
    # repetition_penalty (rl.repetition_penalty, TRL's): transformers' processor over the prompt and the completion
    theirs = lm.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=16, do_sample=False, temperature=None, top_p=None, top_k=None,
                         repetition_penalty=1.8, eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
    ours = sample(lm, [prompt], seeds=[0], max_new_tokens=16, temperature=0.0, top_p=1.0, stop_ids=set(), pad_id=0,
                  repetition_penalty=1.8)
    plain = sample(lm, [prompt], seeds=[0], max_new_tokens=16, temperature=0.0, top_p=1.0, stop_ids=set(), pad_id=0)
    assert ours == [theirs] and ours != plain


def test_a_completion_depends_on_its_seed_not_on_its_batch(lm):
    """The same prompt and seed sample the same completion alone, or third in a left-padded batch of prompts of
    other lengths (as another process, or a resumed run, would batch it); another seed samples another."""
    from llmtrain.model.generate import completion_seed, sample

    prompts = [[1, 5, 9], [1, 30, 31, 32, 33, 34, 35], [1, 12, 7, 40, 41]]
    seeds = [completion_seed(42, 3, i, 0) for i in range(3)]
    kwargs = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, stop_ids={2}, pad_id=0)
    batch = sample(lm, prompts, seeds=seeds, **kwargs)
    alone = sample(lm, prompts[2:], seeds=seeds[2:], **kwargs)
    assert batch[2] == alone[0] and len(alone[0]) > 3
    again = sample(lm, prompts[2:], seeds=[completion_seed(42, 3, 2, 1)], **kwargs)  # the prompt's 2nd generation
    assert again[0] != alone[0]
    assert len({completion_seed(42, s, i, g) for s in range(50) for i in range(50) for g in range(8)}) == 50 * 50 * 8


def test_sampling_follows_the_softmax_and_top_p_keeps_the_nucleus(lm):
    """2,000 completions of one token from one prompt: each token's frequency is its softmax probability (within 4
    standard errors); with top_p the tokens outside the nucleus never come, and a tiny top_p is greedy."""
    from llmtrain.model.generate import sample

    prompt, n = [1, 5, 9, 12], 2000
    probs = torch.softmax(lm(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    drawn = sample(lm, [prompt] * n, seeds=list(range(n)), max_new_tokens=1, temperature=1.0, top_p=1.0,
                   stop_ids={2}, pad_id=0)
    freq = torch.bincount(torch.tensor([c[0] for c in drawn]), minlength=len(probs)).float() / n
    assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt() + 1e-3).all()
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    half = sample(lm, [prompt] * 300, seeds=list(range(300)), max_new_tokens=1, temperature=1.0, top_p=0.5,
                  stop_ids={2}, pad_id=0)
    assert {c[0] for c in half} <= nucleus
    greedy = sample(lm, [prompt] * 20, seeds=list(range(20)), max_new_tokens=1, temperature=1.0, top_p=1e-6,
                    stop_ids={2}, pad_id=0)
    assert {c[0] for c in greedy} == {int(probs.argmax())}


def test_a_completion_ends_with_its_first_stop_token(lm):
    from llmtrain.model.generate import sample

    kwargs = dict(seeds=list(range(40)), max_new_tokens=6, temperature=2.0, top_p=1.0, pad_id=0)
    free = sample(lm, [[1, 5, 9]] * 40, stop_ids=set(), **kwargs)  # nothing stops: every completion is 6 long
    stops = {c[1] for c in free if len(c) > 1}  # tokens drawn second: make them stop tokens
    stopped = sample(lm, [[1, 5, 9]] * 40, stop_ids=stops, **kwargs)
    for a, b in zip(free, stopped):
        assert b == a[: next((k + 1 for k, tok in enumerate(a) if tok in stops), len(a))]
    assert any(len(b) < len(a) for a, b in zip(free, stopped)) and all(len(c) == 6 for c in free)


def test_the_runs_line_on_its_rewards_says_what_the_eval_samples():
    """The run's log line on why the train reward and the eval's differ: one greedy completion a prompt by default, or
    rl.num_generations_eval's N sampled as the rollouts are (it said "one greedy completion" either way)."""
    from llmtrain.config import RLConfig
    from llmtrain.loop.train import rl_eval_line

    rl = RLConfig.model_validate({"num_generations": 4, "rewards": [{"type": "format", "pattern": "x"}]})
    assert "are of one greedy completion of each of the 8 eval prompts, so the train reward usually sits below" in \
        rl_eval_line(rl, 8)
    sampled = rl_eval_line(rl.model_copy(update={"num_generations_eval": 3}), 8)
    assert "are of 3 completions of each of the 8 eval prompts sampled as the rollouts are" in sampled
    assert "greedy" not in sampled and "sits below" not in sampled


@pytest.mark.parametrize("dtype, precision, quantize, fsdp, sixteen", [
    ("float32", "bf16", None, False, False),  # one process or DDP: the base, and so the copy, stay fp32
    ("float32", "bf16", None, True, True),  # FSDP gathers its units in the mixed precision's param_dtype
    ("float32", "bf16", "nf4", False, True),  # a 4-bit base computes in the mixed precision's dtype
    ("float32", "no", "nf4", False, False),
    ("bfloat16", "no", None, False, True),
    ("float32", "no", None, False, False)])
def test_the_header_says_16_bits_only_where_the_merged_copy_is_made_in_16_bits(dtype, precision, quantize, fsdp,
                                                                               sixteen):
    """The sampler's header warns that a 16-bit merged copy drops small adapter changes; an fp32 model with
    train.mixed_precision on one process keeps an fp32 copy (its base layer's dtype: merged_copy._compute_dtype), and
    was warned about all the same."""
    from llmtrain.config import Recipe
    from llmtrain.loop.phases import copy_in_16_bits

    recipe = Recipe.model_validate({"model": {"name_or_path": "m", "dtype": dtype, "quantize": quantize},
                                    "lora": {"r": 4}, "data": {"path": "d.jsonl", "format": "prompt_completion"},
                                    "train": {"mixed_precision": precision}, "output_dir": "o"})
    assert copy_in_16_bits(recipe, fsdp=fsdp) is sixteen


def test_an_fp32_models_merged_copy_is_fp32_under_autocast(tiny_assets):
    """What the row above rests on: the merged copy of an fp32 LoRA model is fp32, inside a bf16 autocast as well."""
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.merged_copy import adapted_linears, merged_weight
    from llmtrain.model.modeling import load_model

    model = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), dtype="float32"), LoraConfig(r=4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {merged_weight(m).dtype for m in adapted_linears(model)} == {torch.float32}


@pytest.mark.parametrize("key", ["rl", "distill"])
def test_a_merged_copy_nothing_would_build_is_refused(key):
    """rl.merged_copy (distill.merged_copy) is what the fast sampler runs a LoRA policy's adapted linears through: a
    full fine-tune (no adapter) or the reference sampler (the training model as it is) took it and did nothing."""
    from pydantic import ValidationError

    from llmtrain.config import Recipe

    section = {"rl": {"rewards": [{"type": "format", "pattern": "x"}]}, "distill": {"teacher": "t"}}[key]
    fmt = {"rl": "prompt", "distill": "prompt_completion"}[key]

    def recipe(lora: bool, **sampling):
        return Recipe.model_validate({"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl", "format": fmt},
                                      key: {**section, **sampling}, "output_dir": "o",
                                      **({"lora": {"r": 4}} if lora else {})})

    assert getattr(recipe(True, merged_copy="kept"), key).merged_copy == "kept"  # LoRA, the fast sampler: built
    assert getattr(recipe(False, sampler="reference"), key).merged_copy == "off"
    with pytest.raises(ValidationError, match=f"{key}.merged_copy=rollout merges LoRA adapters .* Unset {key}"):
        recipe(False, merged_copy="rollout")
    with pytest.raises(ValidationError, match=f"{key}.sampler=reference runs the training model as it is and would "
                                              "ignore it"):
        recipe(True, merged_copy="rollout", sampler="reference")
