"""Distribution, a file per job: building the Accelerator (`accelerator`), the device mesh and what a process reads
from it, such as its data rank (`mesh`), each parallelism in its own file (`fsdp`: FSDP2 and HSDP; `tensor`: tensor
parallelism) or room (`sequence/`: the Ulysses groups, slices and attention; `pipeline/`: the split, the stages, the
schedule that runs a window through them, the groups, the norm and the checkpoint files), the one function that
applies them to a model in a written order (`parallelize`: tensor, sequence, compile, pipeline, then DDP or FSDP), the
run's sequence group and pipeline kept with its Accelerator, never in a module global (`groups`), the collectives the
rest of the package calls (`collectives`: `global_sum`, `data_sum`, `gathered`), and the launch config's checks
(`launch`).

May import: the schema (`config`, `errors`, `layout`, `capabilities`), `data` and `model` (what it parallelises),
and this folder. Inside it, `launch` and `tensor` import no other file of the folder, `sequence/` only its own and
`collectives` (a group's sums), `pipeline/` only its own and `fsdp` (a sharded stage's generation), `groups` those
two rooms, `mesh` only `groups`, `fsdp` only `mesh`, `collectives` `mesh` and `groups`, `accelerator` and
`parallelize` the others (tests/test_layout.py holds them to it). Code elsewhere asks this folder (or the
Accelerator) about ranks and never reads RANK itself.
"""
