"""examples/slurm/llmtrain.sbatch derives every launch flag from SLURM's environment.

SLURM is not here, so `srun`, `scontrol` and `llmtrain` are stand-ins on PATH: srun runs its command once
per node with that node's SLURM_NODEID (as `srun --ntasks-per-node=1` does), scontrol expands the node list,
and llmtrain records its arguments (`llmtrain launch` takes accelerate launch's flags, then the
recipe). The script itself runs unchanged, under bash.
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path

from llmtrain.launcher import accelerate_command

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "llmtrain.sbatch"

STUBS = {
    # srun [options] bash -c CMD: drop the options, run CMD once per node with its node id.
    "srun": 'while [[ "$1" == --* ]]; do shift; done\n'
            'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit; done\n',
    "scontrol": '[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a17\\ngpu-a18\\n"\n',
    "llmtrain": 'printf "%q " "$@" >> "$CALLS"; echo >> "$CALLS"\n',  # each argument as given (shlex reads %q)
    "scancel": 'echo "scancel $*" >> "$CALLS"; [[ -n "${TRAINING:-}" ]] && kill -TERM "$(cat "$TRAINING")"\n',
}


def _slurm(tmp_path: Path, stubs: dict[str, str], **extra: str) -> tuple[dict, Path]:
    """Stand-in commands on PATH and a 2-node job's SLURM environment; returns (env, the calls file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in stubs.items():
        stub = bin_dir / name
        stub.write_text("#!/usr/bin/env bash\n" + body)
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_ID": "123456", **extra}
    return env, calls


def test_sbatch_derives_rank_address_and_port_from_slurm(tmp_path):
    env, calls = _slurm(tmp_path, STUBS, SLURM_GPUS_ON_NODE="8")
    subprocess.run(["bash", str(SBATCH), "recipes/llama7b.yaml", "train.lr=2e-5"], env=env, cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=60)

    launches = [shlex.split(line) for line in calls.read_text().splitlines()]
    assert len(launches) == 2  # one `llmtrain launch` per node
    for rank, args in enumerate(launches):
        flags = dict(zip(args[1::2], args[2::2]))
        assert args[0] == "launch"
        assert flags["--config_file"] == "accelerate_configs/hsdp_multinode.yaml"
        assert flags["--machine_rank"] == str(rank)
        assert flags["--num_machines"] == "2" and flags["--num_processes"] == "16"
        # HSDP: replicas = nodes, shards = GPUs per node
        assert flags["--parallelism_config_dp_replicate_size"] == "2"
        assert flags["--parallelism_config_dp_shard_size"] == "8"
        assert flags["--main_process_ip"] == "gpu-a17"  # the allocation's first node, on every node
        assert flags["--main_process_port"] == str(20000 + 123456 % 20000)
        assert args[-4:] == ["recipes/llama7b.yaml", "--resume", "auto", "train.lr=2e-5"]
        # llmtrain launch's own checks pass (the layout, the recipe; not this machine's GPUs): accelerate launch follows
        assert accelerate_command(args[1:], machine=False)[-4:] == args[-4:]


def test_sbatch_passes_each_override_as_given(tmp_path):
    """An override with spaces, quotes or $ in its value reached llmtrain split into words (and evaluated) by the
    inner `bash -c`: "Override 'are' is not of the form key=value"."""
    env, calls = _slurm(tmp_path, STUBS, SLURM_GPUS_ON_NODE="8")
    given = ["data.system_prompt=You are terse; say \"$HOME\" as is", "train.lr=2e-5"]
    subprocess.run(["bash", str(SBATCH), "recipes/my recipe.yaml", *given], env=env, cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=60)
    for args in (shlex.split(line) for line in calls.read_text().splitlines()):
        assert args[-5:] == ["recipes/my recipe.yaml", "--resume", "auto", *given]


def _launch_env(args: list[str]) -> dict:
    """What the real `accelerate launch ARGS` would give each worker's environment (its own parser and config)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parsed, _, _ = _validate_launch_command(launch_command_parser().parse_args(args))
    return prepare_multi_gpu_env(parsed)


def test_sbatch_lays_out_hsdp_as_nodes_x_gpus_and_fsdp_on_request(tmp_path):
    """4 nodes of 4 GPUs: accelerate gives the workers a 4 x 4 mesh (replicas x shards) under FSDP2; with
    LLMTRAIN_ACCELERATE_CONFIG=fsdp_multinode.yaml no mesh is passed and every GPU of the job is one shard group."""
    env, calls = _slurm(tmp_path, STUBS, SLURM_GPUS_ON_NODE="4", SLURM_NNODES="4")
    subprocess.run(["bash", str(SBATCH), "recipes/llama7b.yaml"], env=env, cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=60)
    launches = [shlex.split(line) for line in calls.read_text().splitlines()]
    assert len(launches) == 4
    worker = _launch_env(launches[3][1:])
    assert worker["ACCELERATE_USE_FSDP"] == "true" and worker["FSDP_VERSION"] == "2"
    assert worker["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (worker["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], worker["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("4", "4")

    calls.unlink()
    env["LLMTRAIN_ACCELERATE_CONFIG"] = "accelerate_configs/fsdp_multinode.yaml"
    subprocess.run(["bash", str(SBATCH), "recipes/llama7b.yaml"], env=env, cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=60)
    launch = shlex.split(calls.read_text().splitlines()[0])
    assert not any(a.startswith("--parallelism_config") for a in launch)
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in _launch_env(launch[1:])


def test_sbatch_adds_tensor_parallelism_within_each_node_on_request(tmp_path):
    """LLMTRAIN_TP=2 on 2 nodes of 8: accelerate gives the workers replicas 2 x shards 4 x tp 2 (HSDP x TP); a TP
    size that does not divide the node's GPUs, or TP with a config without a mesh, stops before any launch."""
    env, calls = _slurm(tmp_path, STUBS, SLURM_GPUS_ON_NODE="8", LLMTRAIN_TP="2")
    subprocess.run(["bash", str(SBATCH), "recipes/llama7b.yaml"], env=env, cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=60)
    worker = _launch_env(shlex.split(calls.read_text().splitlines()[1])[1:])
    assert (worker["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], worker["PARALLELISM_CONFIG_DP_SHARD_SIZE"],
            worker["PARALLELISM_CONFIG_TP_SIZE"]) == ("2", "4", "2")
    calls.unlink()
    for bad in ({"LLMTRAIN_TP": "3"}, {"LLMTRAIN_ACCELERATE_CONFIG": "accelerate_configs/fsdp_multinode.yaml"}):
        proc = subprocess.run(["bash", str(SBATCH), "recipes/llama7b.yaml"], env={**env, **bad}, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "LLMTRAIN_TP" in proc.stderr and not calls.exists()


def test_sbatch_checkpoints_and_requeues_before_the_time_limit(tmp_path):
    """SLURM's USR1 (--signal=B:USR1@300) reaches the script while the training step runs: it sends SIGTERM to
    the step's tasks (scancel --signal=TERM JOB.0), waits for them to checkpoint and exit, then requeues."""
    training = tmp_path / "training.pid"
    stubs = {**STUBS,
             # the training step: a task that runs until SIGTERM, then "saves" and exits 143 as llmtrain does
             "srun": f'echo $$ > {training}; trap \'echo saved >> "$CALLS"; exit 143\' TERM; '
                     'while true; do sleep 0.05; done\n',
             "scontrol": STUBS["scontrol"] + '[[ "$1" == requeue ]] && echo "requeue $2" >> "$CALLS"\n'}
    env, calls = _slurm(tmp_path, stubs, TRAINING=str(training))
    proc = subprocess.Popen(["bash", str(SBATCH), "recipes/llama7b.yaml"], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for _ in range(200):
        if training.is_file() and training.read_text().strip():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what SLURM sends 300 s before the limit
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert calls.read_text().splitlines() == ["scancel --signal=TERM 123456.0", "saved", "requeue 123456"]
    assert "requeueing job 123456" in out
