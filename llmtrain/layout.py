"""The layout: how a run's processes are laid out, one object built once from the launch and the recipe.

A run's processes split the work along up to five dimensions, applied in this order (as torchtitan's ParallelDims):
tensor parallelism inside a group of `tp` consecutive ranks, sequence parallelism (the recipe's
parallel.sequence_parallel), pipeline stages (parallel.pipeline_parallel, the outer dimension), and data parallelism
over what is left, as DDP or as FSDP shards (HSDP: `replicate` replicas of `shard` shards). The launch decides the
processes, the nodes, FSDP and its mesh (accelerate's parallelism_config: replicate x shard x tp); the recipe decides
sp and pp. `Layout.problems` checks the degrees once, all of them together: the product of the mesh equals the
processes, each degree divides what it must, and the dimensions that do not compose are not asked for together.

`llmtrain launch` and `llmtrain doctor` build one from the launch config and its flags (`from_launch`; so does
`estimate-memory --accelerate-config`, memory/launch.py, with the launch's FSDP settings it prices), every process of
`finetune` from the variables `accelerate launch` set (`from_environment`), and `estimate-memory` from the strategy
it estimates (`of_strategy`).
What each training mode runs on each layout is capabilities.py's table.

May import: the schema (`config`, `errors`) only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# The columns of the capability table (capabilities.py): a layout is one or several of them.
PARALLELISMS: tuple[str, ...] = ("single", "ddp", "fsdp", "tp", "sp", "pp")
NAMES = {"single": "one process", "ddp": "DDP", "fsdp": "FSDP / HSDP", "tp": "tensor parallelism (FSDP x TP)",
         "sp": "sequence parallelism", "pp": "pipeline parallelism"}


@dataclass(frozen=True)
class Layout:
    """The degrees of a run's layout. `processes` is the whole job's (every node's)."""

    processes: int = 1
    nodes: int = 1
    fsdp: bool = False  # the launch shards with FSDP2 (distributed_type: FSDP)
    offload: bool = False  # FSDP keeps the shards on the host (fsdp_config's fsdp_offload_params)
    mesh: bool = False  # the launch has a parallelism_config section (HSDP, FSDP x TP)
    replicate: int = 1  # HSDP's replicas (parallelism_config_dp_replicate_size)
    shard: int = 1  # the mesh's FSDP shards (parallelism_config_dp_shard_size); without a mesh, unused
    tp: int = 1  # tensor-parallel ranks of a group (parallelism_config_tp_size)
    sp: int = 1  # parallel.sequence_parallel
    pp: int = 1  # parallel.pipeline_parallel
    cp: int = 1  # accelerate's own context parallelism (parallelism_config_cp_size): refused
    accelerate_sp: int = 1  # accelerate's own sequence parallelism (parallelism_config_sp_size): refused
    launched: bool = True  # the processes are known (a launch, a launch config); False: the recipe alone
    where: str = "the launch"  # what the processes and the mesh came from, for the messages
    reshard: bool = True  # FSDP frees each layer's gathered weights after its forward (fsdp_reshard_after_forward)
    precision: str | None = None  # the launch config's mixed_precision (llmtrain runs with the recipe's)

    # ------------------------------------------------------------------ built from

    @classmethod
    def from_recipe(cls, recipe) -> Layout:
        """What the recipe alone says (sequence and pipeline degrees), the processes not known yet."""
        return cls(sp=recipe.parallel.sequence_parallel, pp=recipe.parallel.pipeline_parallel, launched=False,
                   where="the recipe")

    @classmethod
    def from_launch(cls, launch: dict, recipe=None, *, where: str = "the launch config") -> Layout:
        """From an accelerate launch config as its YAML reads (with the command line's flags over it:
        parallel.launch.launch_settings), and the recipe (None: the launch alone, as estimate-memory reads one)."""
        mesh = launch.get("parallelism_config")
        sizes = mesh_sizes(launch) or {}
        fsdp = str(launch.get("distributed_type", "NO")) == "FSDP"
        offload = fsdp_flag(launch, "fsdp_offload_params", False)
        given = launch.get("num_processes")  # (0 kept: it had read as 1, and torchrun's AssertionError followed)
        precision = launch.get("mixed_precision")
        return cls(processes=1 if given is None else int(given), nodes=int(launch.get("num_machines", 1) or 1),
                   fsdp=fsdp, offload=fsdp and offload, mesh=isinstance(mesh, dict),
                   replicate=sizes.get("dp_replicate", 1), shard=sizes.get("dp_shard", 1), tp=sizes.get("tp", 1),
                   cp=sizes.get("cp", 1), accelerate_sp=sizes.get("sp", 1),
                   sp=recipe.parallel.sequence_parallel if recipe is not None else 1,
                   pp=recipe.parallel.pipeline_parallel if recipe is not None else 1, where=where,
                   reshard=not fsdp or fsdp_flag(launch, "fsdp_reshard_after_forward", True),
                   precision=None if precision is None else str(precision))

    @classmethod
    def of_strategy(cls, recipe, strategy: str, *, gpus: int, nodes: int = 1, tp: int = 1,
                    offload: bool = False) -> Layout:
        """As estimate-memory names a launch: single, ddp, fsdp or hsdp (replicas = nodes) on `gpus` a node, x `tp`,
        with or without FSDP's offload."""
        world, hsdp = gpus * nodes, strategy == "hsdp"
        return cls(processes=world, nodes=nodes, fsdp=strategy in ("fsdp", "hsdp"), mesh=hsdp or tp > 1,
                   offload=offload and strategy in ("fsdp", "hsdp"),
                   replicate=nodes if hsdp else 1, shard=world // (nodes if hsdp else 1) // tp, tp=tp,
                   sp=recipe.parallel.sequence_parallel, pp=recipe.parallel.pipeline_parallel, where="the estimate")

    @classmethod
    def from_environment(cls, recipe, environ=None) -> Layout:
        """In a process of the job: from what `accelerate launch` (torchrun) set (WORLD_SIZE, ACCELERATE_USE_FSDP,
        PARALLELISM_CONFIG_*), and the recipe. Without a launcher: one process."""
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_WORLD_SIZE", world) or world)
        mesh = env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"

        def size(key: str) -> int:
            return int(env.get(f"PARALLELISM_CONFIG_{key.upper()}_SIZE", "1") or 1) if mesh else 1

        fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        return cls(processes=world, nodes=max(1, world // max(local, 1)), fsdp=fsdp,
                   offload=fsdp and env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true", mesh=mesh,
                   replicate=size("dp_replicate"), shard=size("dp_shard"), tp=size("tp"), cp=size("cp"),
                   accelerate_sp=size("sp"), sp=recipe.parallel.sequence_parallel,
                   pp=recipe.parallel.pipeline_parallel, where="the launch config")

    # ------------------------------------------------------------------ what it is

    @property
    def parallelisms(self) -> tuple[str, ...]:
        """The columns of the capability table this layout runs under: one of single / ddp / fsdp (the data
        parallelism), and tp, sp, pp where they are on. The recipe alone (processes unknown) gives sp and pp only."""
        kinds = []
        if self.launched:
            kinds.append("fsdp" if self.fsdp else "ddp" if self.processes > 1 else "single")
        kinds += [k for k, n in (("tp", self.tp), ("sp", self.sp), ("pp", self.pp)) if n > 1]
        return tuple(kinds)

    @property
    def strategy(self) -> str:
        """The data parallelism as estimate-memory names it: single, ddp, fsdp, or hsdp (FSDP over a mesh with
        replicas)."""
        if self.fsdp:
            return "hsdp" if self.mesh and self.replicate > 1 else "fsdp"
        return "ddp" if self.processes > 1 else "single"

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.processes // max(1, self.nodes))

    def estimate_layout(self) -> dict:
        """This layout as memory.spec.spec_from_recipe takes it (strategy, GPUs a node, nodes, offload, TP, reshard)."""
        return dict(strategy=self.strategy, num_gpus=self.gpus_per_node, num_nodes=self.nodes,
                    cpu_offload=self.offload, tp=self.tp, reshard_after_forward=self.reshard)

    @property
    def splits_the_model(self) -> bool:
        """Tensor, sequence or pipeline parallelism: what the model's own shape (heads, layers) must allow."""
        return self.tp * self.sp * self.pp > 1

    @property
    def data_ranks(self) -> int:
        """Processes that read different batches: a tensor-parallel group, a sequence group and a pipeline's stages
        each read one."""
        return max(1, self.processes // (self.tp * self.sp * self.pp))

    @property
    def weight_share(self) -> int:
        """Into how many parts a parameter that is not split by tensor parallelism is divided over the processes: FSDP's
        shards (a mesh's dp_shard, else every process of a stage) times the pipeline's stages (each holds its own
        layers); 1 on one process and under DDP, where every process holds the whole."""
        shards = (max(1, self.shard) if self.mesh else max(1, self.processes // self.pp)) if self.fsdp else 1
        return shards * self.pp

    def each_holds(self) -> str:
        """Where such a parameter's bytes are (after them in a sentence): ' on every process', or each one's share."""
        n = self.weight_share
        return " on every process" if n == 1 else f", 1/{n} of it on each process ({self.describe()})"

    def describe(self) -> str:
        """The layout in a few words: '4 processes: FSDP, 2 shards x 2 tensor-parallel'."""
        # DDP only where there is more than one replica (2 processes as 2 pipeline stages are none)
        parts = [NAMES[k] for k in self.parallelisms if not (k == "ddp" and self.data_ranks == 1)]
        degrees = [f"{n} {name}" for n, name in ((self.replicate, "replicas"), (self.tp, "tensor-parallel"),
                                                 (self.sp, "a sequence"), (self.pp, "stages")) if n > 1]
        head = f"{self.processes} process{'es' if self.processes != 1 else ''}" if self.launched else "the recipe"
        return f"{head}: {' + '.join(parts) or 'no parallelism'}" + (f" ({', '.join(degrees)})" if degrees else "")

    # ------------------------------------------------------------------ its degrees, checked once

    def problems(self) -> list[str]:
        """Every problem of the degrees themselves, each one sentence naming the key and the fix (the recipe's
        training mode on the layout: capabilities.problems)."""
        out: list[str] = []
        sp_key, pp_key = f"parallel.sequence_parallel={self.sp}", f"parallel.pipeline_parallel={self.pp}"
        if self.sp > 1 and self.pp > 1:
            out.append("parallel.pipeline_parallel and parallel.sequence_parallel do not compose yet: choose one "
                       "(sequence parallelism for long rows, pipeline stages for a model split over nodes)")
        if self.launched and (self.processes < 1 or self.processes % self.nodes):
            # accelerate starts num_processes // num_machines a node: 0, or fewer than the job's count
            return out + [f"{self.where} has num_processes {self.processes} over num_machines {self.nodes}, and "
                          f"accelerate starts num_processes // num_machines = {self.processes // self.nodes} on each "
                          "node: give --num_processes as the processes of every node together, a multiple of "
                          f"--num_machines (e.g. {8 * self.nodes} for 8 GPUs on each of {self.nodes} node"
                          f"{'s' * (self.nodes != 1)})"]
        if self.launched:
            out += self._mesh_problems()
            for n, key, what in ((self.sp, sp_key, "splits each sequence over"),
                                 (self.pp, pp_key, "splits the model into stages on")):
                if n == 1:
                    continue
                if self.processes == 1 and self.where == "the estimate":
                    out.append(f"{key} {what} {n} processes, and the estimate is of one GPU: give --num-gpus {n} "
                               f"and --strategy ddp or fsdp, or set {key.split('=')[0]}=1")
                elif self.processes == 1:
                    out.append(f"{key} {what} {n} processes, and this is one process (no launcher started it): run "
                               f"it with `llmtrain launch --config_file accelerate_configs/ddp.yaml --num_processes "
                               f"{n} RECIPE.yaml` (on a CPU: accelerate_configs/cpu_ddp.yaml), or set "
                               f"{key.split('=')[0]}=1")
                elif self.processes % n:
                    out.append(f"{key} {what} {n} processes, but the launch has {self.processes}: launch a multiple "
                               f"of {n} processes (--num_processes), or set {key.split('=')[0]} to a divisor of "
                               f"{self.processes}")
            if self.sp > 1 and self.mesh:
                out.append(f"{sp_key} runs on a plain DDP or FSDP launch (accelerate_configs/ddp.yaml, fsdp.yaml); "
                           f"{self.where} has a parallelism_config mesh (HSDP or tensor parallelism), which sequence "
                           "parallelism is not built to compose with yet. Drop the parallelism_config section, or set "
                           "parallel.sequence_parallel=1")
            if self.tp > 1 and self.offload:  # the estimate refuses it too (spec.py): never trained or measured
                out.append(f"{self.where} sets fsdp_offload_params: true with tensor parallelism "
                           f"(parallelism_config_tp_size: {self.tp}); llmtrain trains FSDP x TP without the offload "
                           "(it is neither measured nor estimated). Set fsdp_offload_params: false, or drop tensor "
                           "parallelism for FSDP with the offload (accelerate_configs/fsdp.yaml)")
            if self.pp > 1 and self.offload:
                out.append(f"{pp_key} shards each stage with FSDP2 over its replicas and keeps the shards on the GPU; "
                           f"{self.where} sets fsdp_offload_params: true, which the stages do not apply (a run would "
                           "hold what the launch meant for the host without a word). Set fsdp_offload_params: false "
                           "(more stages, or LoRA, hold less on each GPU), or set parallel.pipeline_parallel=1 for "
                           "FSDP with the offload")
            if self.pp > 1 and self.mesh:
                out.append(f"{pp_key} runs on a plain multi-process launch (the replicas of a stage sum their "
                           "gradients: accelerate_configs/ddp.yaml) or an FSDP one (each stage sharded over its "
                           f"replicas: fsdp.yaml); {self.where} has a parallelism_config mesh (HSDP or tensor "
                           "parallelism), which is not built inside pipeline stages yet. Drop the parallelism_config "
                           "section, or set parallel.pipeline_parallel=1")
        return out

    def _mesh_problems(self) -> list[str]:
        """The parallelism_config mesh against FSDP and the processes (accelerate's own checks come later, once per
        process, and less clearly)."""
        if not self.mesh:
            return []
        where = f"in the parallelism_config of {self.where}"
        if self.cp > 1 or self.accelerate_sp > 1:
            kind, key = ("context", "cp") if self.cp > 1 else ("sequence", "sp")
            return [f"{kind} parallelism through accelerate (parallelism_config_{key}_size > 1 {where}) is not what "
                    f"llmtrain runs: accelerate's needs DeepSpeed (sp) or turns packed rows into one causal sequence "
                    f"(cp). Set parallelism_config_{key}_size: 1 and split each sequence with the recipe's "
                    "parallel.sequence_parallel: N (Ulysses, on a plain DDP or FSDP launch: docs/sequence-parallel.md)"]
        if not self.fsdp:
            return ["a parallelism_config mesh needs FSDP: set distributed_type: FSDP with fsdp_version: 2 in the "
                    "launch config (accelerate_configs/hsdp_multinode.yaml), or drop parallelism_config for plain "
                    "data parallelism (accelerate_configs/ddp.yaml)"]
        if self.tp > 1 and self.shard < 2:
            shards = self.processes // (self.replicate * self.tp)
            fix = (f"set parallelism_config_dp_shard_size: {shards} (the {self.processes} processes over "
                   f"{self.tp} tensor-parallel ranks{' and the replicas' if self.replicate > 1 else ''})"
                   if shards >= 2 else
                   f"launch at least {2 * self.tp * self.replicate} processes (2 shards x {self.tp} tensor-parallel "
                   f"ranks{f' x {self.replicate} replicas' if self.replicate > 1 else ''}) with "
                   "parallelism_config_dp_shard_size: 2")
            return [f"tensor parallelism (parallelism_config_tp_size: {self.tp} {where}) runs under FSDP2 as FSDP x TP "
                    f"(or HSDP x TP), which needs at least 2 shards: {fix} (accelerate_configs/fsdp_tp.yaml), or "
                    "lower parallelism_config_tp_size, or shard with plain FSDP over the same GPUs "
                    "(accelerate_configs/fsdp.yaml)"]
        if self.shard < 2:  # (accelerate's ValueError in every process: "no dimension for FSDP to shard across")
            return [f"the mesh {where} has parallelism_config_dp_shard_size: {self.shard}, and FSDP2 needs at least 2 "
                    "shards to shard over (replicas alone are plain data parallelism): set "
                    "parallelism_config_dp_shard_size to the GPUs of a node (at least 2), use "
                    "accelerate_configs/ddp.yaml for replicas alone, or fsdp_multinode.yaml to shard over every GPU"]
        sizes = [(self.replicate, "replicas", "dp_replicate"), (self.shard, "shards", "dp_shard"),
                 (self.tp, "tensor-parallel ranks", "tp")]
        sizes = [x for x in sizes if x[0] > 1 or x[2] == "dp_shard"]
        size = self.replicate * self.shard * self.tp
        if size == self.processes:
            return []
        return [f"the launch config's mesh is {' x '.join(str(n) for n, _, _ in sizes)} = {size} processes "
                f"({' x '.join(f'parallelism_config_{key}_size' for _, _, key in sizes)}) but the job has "
                f"{self.processes} processes. Make {' x '.join(name for _, name, _ in sizes)} equal the processes: "
                f"replicas = nodes and shards x tp = GPUs per node ({self._mesh_example()})"]

    def _mesh_example(self) -> str:
        """accelerate launch flags whose mesh fits the processes on the nodes, keeping the config's TP."""
        tp, world, nodes = self.tp, self.processes, self.nodes
        shards = world // (nodes * tp) if world % (nodes * tp) == 0 else 0
        if shards < 2:
            return ("e.g. --parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 8 for 2 nodes "
                    "of 8, or --parallelism_config_dp_shard_size 4 --parallelism_config_tp_size 2 for 8 GPUs")
        flags = ([f"--parallelism_config_dp_replicate_size {nodes}"] if nodes > 1 else []) + [
            f"--parallelism_config_dp_shard_size {shards}"] + ([f"--parallelism_config_tp_size {tp}"] if tp > 1 else [])
        return f"for these {world} processes on {nodes} node{'s' if nodes > 1 else ''}: {' '.join(flags)}"


def mesh_sizes(launch: dict) -> dict[str, int] | None:
    """An accelerate launch config's parallelism_config section as its sizes (dp_replicate, dp_shard, tp, cp, sp:
    1 where not given); None without one."""
    mesh = launch.get("parallelism_config")
    if not isinstance(mesh, dict):
        return None
    return {k: int(mesh.get(f"parallelism_config_{k}_size", 1) or 1) for k in ("dp_replicate", "dp_shard", "tp",
                                                                               "cp", "sp")}


def fsdp_flag(launch: dict, key: str, default: bool) -> bool:
    """A true/false setting of an accelerate launch config's fsdp_config (fsdp_offload_params,
    fsdp_reshard_after_forward) as accelerate reads it: the YAML's true or false, or the string "true"/"True" or
    "false" that `accelerate config` and a command line's flag write (bool("false") is not false); `default` where
    it is absent or another value."""
    value = str((launch.get("fsdp_config") or {}).get(key, default)).lower()
    return True if value == "true" else False if value == "false" else default
