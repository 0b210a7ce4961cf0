"""The run's process groups beyond the Accelerator's own: a sequence group and a pipeline, made once per run.

`build_accelerator` makes them from the run's layout (layout.py) once the process group exists and keeps them on the
Accelerator it returns (`accelerator.llmtrain_groups`), the one object every phase of a run is handed: nothing keeps a
process group in a module global, so a second run in one process (a notebook, the tests) starts from its own.
`groups(accelerator)` reads them back (none for an Accelerator built elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.parallel.pipeline.group import PipelineGroup
from llmtrain.parallel.sequence.group import SequenceGroup


@dataclass(frozen=True)
class Groups:
    sequence: SequenceGroup = field(default_factory=SequenceGroup)  # size 1: sequence parallelism off
    pipeline: PipelineGroup = field(default_factory=PipelineGroup)  # size 1: no stages


def make_groups(*, sequence_parallel: int, pipeline_parallel: int) -> Groups:
    from llmtrain.parallel.pipeline import group as pipeline
    from llmtrain.parallel.sequence import group as sequence

    return Groups(sequence=sequence.make_group(sequence_parallel), pipeline=pipeline.make_group(pipeline_parallel))


def groups(accelerator) -> Groups:
    """The run's groups (build_accelerator's); none for an Accelerator built elsewhere."""
    return getattr(accelerator, "llmtrain_groups", None) or Groups()
