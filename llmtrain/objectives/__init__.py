"""Objectives: what a batch is and what is minimised, the one seam between the data and the training loop.

- `objective.py`: the `Objective` protocol the loop calls, causal-LM cross-entropy (supervised fine-tuning) and
  `objective_for`, which picks the recipe's.
- `preference.py`: DPO, IPO and SimPO on packed pairs, and the reference log-probabilities.

May import: the schema, `data`, `model`, `parallel` and this folder. Never the run folder or the loop.
"""
