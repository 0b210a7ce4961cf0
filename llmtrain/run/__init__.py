"""What a run reads and writes: the run folder, checkpoints and the training state they resume, resume checks,
metrics.jsonl (FLOPs, MFU), trackers, loss.png, samples, the console and train.log, and the exported model.

- `rundir.py` (the folder and its lock), `checkpoint.py`, `state.py` (`TrainState`), `preflight.py` (resume
  checks), `metrics.py`, `trackers.py`, `plot.py` (RL: `rl_plot.py`), `samples.py`, `console.py`, `export.py`.

May import: the schema, `data`, `model`, `parallel`, `objectives`, `memory` and this folder. Never the loop.
"""
