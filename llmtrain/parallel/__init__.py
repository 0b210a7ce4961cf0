"""Distribution: the Accelerator, the device mesh (DDP, FSDP2, HSDP), tensor parallelism and the collectives
the rest of the package calls (`global_sum`, `data_sum`, the data-parallel ranks).

May import: the schema (`config`, `errors`) and this folder. Code elsewhere asks this folder (or the
Accelerator) about ranks and never reads RANK itself.
"""
