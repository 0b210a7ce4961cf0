"""Objectives: what a batch is and what is minimised, the one seam between the data and the training loop.

- `objective.py`: the `Objective` protocol the loop calls, causal-LM cross-entropy (supervised fine-tuning) and
  `objective_for`, which picks the recipe's.
- `preference.py`: DPO, IPO and SimPO on packed pairs, and the reference log-probabilities.
- `grpo.py`: online RL's (GRPO) pure pieces: group advantages and the clipped per-token loss with its k3 KL,
  normalised per loss_type as TRL 1.16 does (equal to its GRPOTrainer to 1e-6, packed against padded). Not yet
  an objective the loop runs: the step (generation with model/generate.py, scoring, the packed update) is the
  next part of the RL issue.
- `rewards.py`: reward functions (answer_match, format, the user's own with TRL's signature) and their checks.

May import: the schema, `data`, `model`, `parallel` and this folder. Never the run folder or the loop.
"""
