"""Distribution, a file per job: building the Accelerator (`accelerator`), the device mesh and what a process reads
from it, such as its data rank (`mesh`), each parallelism in its own file (`fsdp`: FSDP2 and HSDP; `tensor`: tensor
parallelism) or room (`sequence/`: the Ulysses groups, slices and attention; `pipeline/`: the split, the stages, the
schedule that runs a window through them, the groups, the norm and the checkpoint files), the one function that
applies them to a model in a written order (`parallelize`: tensor, sequence, compile, pipeline, then DDP or FSDP), the
run's sequence group and pipeline kept with its Accelerator, never in a module global (`groups`), the collectives the
rest of the package calls (`collectives`: `global_sum`, `data_sum`, `gathered`), and the launch config's checks
(`launch`).

May import: the schema (`config`, `errors`, `layout`, `capabilities`), `data` and `model` (what it parallelises),
and this folder. Inside it, `launch` and `tensor` import no other file of the folder, `sequence/` and `pipeline/`
none but their own, `groups` those two, `mesh` only `groups`, `fsdp` and `collectives` only `mesh`, `accelerator`
and `parallelize` the others. Code elsewhere asks this folder (or the Accelerator) about ranks and never reads RANK
itself.
"""
