"""Objectives: what a batch is and what is minimised, the one seam between the data and the training loop.

- `objective.py`: the `Objective` protocol the loop calls, causal-LM cross-entropy (supervised fine-tuning) and
  `objective_for`, which picks the recipe's.
- `preference.py`: DPO, IPO, SimPO, ORPO and TRL's other pair losses (weighted mixes, f-DPO, LD-DPO, WPO) on packed
  pairs, and the reference log-probabilities.
- `grpo.py`: online RL (GRPO): group advantages and the clipped per-token loss with its k3 KL, normalised per
  loss_type as TRL 1.16 does (equal to its GRPOTrainer to 1e-6, packed against padded), and the objective the
  loop runs: its `rollout` samples each step's completions (model/generate.py), scores and packs them.
- `rloo.py`: online RL (RLOO, rl.algorithm: rloo) on GRPO's rollout: the leave-one-out advantage, the k1 KL in the
  reward and the per-sequence clipped loss, as TRL 1.16's RLOOTrainer (equal to it to 1e-6).
- `distill.py`: on-policy distillation (TRL's DistillationTrainer): the generalised JSD to a teacher over completion
  tokens, chunk by chunk beside the student's head, on completions the student samples (a seeded coin per step).
- `rollouts.py`: what the sampling objectives share: the policy in sampling order for a window (eval mode, FSDP's
  units gathered once), its completions by the recipe's sampler, each completion made a trained row, and PPO's
  clipped surrogate (per token in GRPO, per sequence in RLOO).
- `rewards.py`: reward functions (answer_match, format, the user's own with TRL's signature) and their checks.
- `reward_model.py`: reward models on pairs (TRL's RewardTrainer loss on the score head's last-token scores).
- `learned_reward.py`: a trained reward model as an RL reward (rl.rewards type reward_model).

May import: the schema, `data`, `model`, `parallel` and this folder. Never the run folder or the loop.
"""
