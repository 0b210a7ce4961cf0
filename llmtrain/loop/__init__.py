"""The training loop: `train()` reads top to bottom in `train.py`; its pieces beside it.

- `phases.py`: the set-up phases, each returning a small frozen object (the run folder is first written by
  `claim_run_dir`).
- `step.py`: `train_step` and `evaluate` (on pipeline stages, parallel/pipeline/schedule.py runs the window).
- `cadence.py` (when to log, evaluate, save), `meter.py` (the metrics line and speed), `guards.py` (non-finite
  steps), `signals.py` (SIGTERM and Ctrl-C), `rounds.py` (online RL's generation rounds, rl.num_iterations: which
  step samples, which reuse its round's completions, and the round a checkpoint keeps).

May import: every folder below it (the schema, `data`, `model`, `parallel`, `objectives`, `memory`, `run`).
Only the commands (`cli.py`) import the loop.
"""
