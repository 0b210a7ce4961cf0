"""Launch settings llmtrain does not follow are refused, by doctor, by `llmtrain launch` before any process starts
(exit 2, one paragraph, nothing written) and by finetune's processes under a plain `accelerate launch`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO
from helpers import ENV, cli, open_port, records, write_recipe

from llmtrain.parallel.launch import launch_settings, unhonoured

SHIPPED = sorted((REPO / "accelerate_configs").glob("*.yaml"))


pytestmark = pytest.mark.long(70)  # tests/conftest.py


def config(tmp_path, name="launch.yaml", base="cpu_fsdp.yaml", **changes) -> tuple:
    launch = yaml.safe_load((REPO / "accelerate_configs" / base).read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            launch.setdefault(key, {}).update(value)
        elif value is None:  # the key left out
            launch.pop(key, None)
        else:
            launch[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(launch))
    return path, launch


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_launch_config_is_honoured(path):
    assert unhonoured(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("changes, said", [
    ({"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_pp_size": 2}},
     "parallelism_config_pp_size: 2 asks accelerate for pipeline parallelism, which it does not implement"),
    ({"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_ep_size": 4}},
     "parallelism_config_ep_size: 4 asks for expert parallelism"),
    ({"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_foo": "x"}},
     "parallelism_config_foo: x is not a key accelerate knows"),
    ({"distributed_type": "DEEPSPEED"}, "distributed_type: DEEPSPEED is not trained by llmtrain"),
    ({"deepspeed_config": {"zero_stage": 3}}, "deepspeed_config is not honoured"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "set model.compile=true in the recipe"),
    ({"fsdp_config": {"fsdp_activation_checkpointing": True}}, "turn on model.gradient_checkpointing"),
    ({"fsdp_config": {"fsdp_version": 1}}, "fsdp_version: 1 is not supported"),
    ({"fsdp_config": {"fsdp_ofload_params": True}},
     "fsdp_ofload_params is not a setting accelerate knows (did you mean fsdp_offload_params?)"),
    ({"num_gpus": 8}, "num_gpus is not a setting of accelerate's launch config: remove it"),
    ({"num_proceses": 8}, "num_proceses is not a setting of accelerate's launch config (did you mean num_processes?)"),
    ({"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_szie": 2}},
     "parallelism_config_tp_szie: 2 is not a key accelerate knows (did you mean parallelism_config_tp_size?)"),
    ({"fp8_config": {"backend": "TE"}}, "fp8_config is not honoured"),
    # each of these had been let through, then trained otherwise or failed in every process (audit 8)
    ({"base": "cpu_ddp.yaml", "distributed_type": "MULTI_CPU"},
     "distributed_type: MULTI_CPU starts one process without an mpirun hostfile (accelerate's simple launcher), not "
     "the 2 of num_processes"),
    ({"base": "cpu_ddp.yaml", "distributed_type": "NO"},  # checked as 2 DDP processes, trained as one (audit 34)
     "distributed_type: NO starts one process (accelerate's simple launcher), not the 2 of num_processes"),
    ({"fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}},
     "fsdp_sharding_strategy: HYBRID_SHARD is FSDP1's, which accelerate ignores under fsdp_version 2 (the run would "
     "shard over every GPU): for it under FSDP2 use a parallelism_config mesh of replicas x shards"),
    ({"fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}}, "use plain data parallelism"),
    ({"fsdp_config": {"fsdp_reshard_after_forward": "FULL_SHARD"}},
     "fsdp_reshard_after_forward: FULL_SHARD is an FSDP1 sharding strategy's name"),
    ({"fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT"}},
     "fsdp_state_dict_type: FULL_STATE_DICT: llmtrain's FSDP checkpoints are sharded"),
    ({"fsdp_config": {"fsdp_offload_params": True}},
     "fsdp_offload_params: true moves the shards to pinned host memory for a GPU to read, and this is a CPU launch"),
])
def test_a_setting_llmtrain_does_not_follow_is_named_with_its_fix(tmp_path, changes, said):
    _, launch = config(tmp_path, **changes)
    problems = unhonoured(launch)
    assert len(problems) == 1 and said in problems[0], problems


def test_flags_accelerate_launch_would_drop_are_refused_with_the_launch():
    """accelerate launch reads the mesh flags only for a config with a parallelism_config section (or with --use_fsdp
    --use_parallelism_config), drops a config's section under --use_fsdp / --multi_gpu, and starts one process under
    --cpu: each had been checked as the layout asked for while the run trained another (FSDP over every process,
    twice the global batch; audit 8). Read with accelerate's own rule, each is refused; the launches it honours are
    not."""
    def problems(*argv):
        launch, _ = launch_settings([*argv, "recipes/tiny.yaml"])
        return unhonoured(launch)

    fsdp, tp, ddp = (str(REPO / "accelerate_configs" / n) for n in ("cpu_fsdp.yaml", "cpu_tp.yaml", "cpu_ddp.yaml"))
    (said,) = problems("--config_file", fsdp, "--num_processes", "4", "--parallelism_config_dp_shard_size", "2",
                       "--parallelism_config_tp_size", "2")
    assert said.startswith("--parallelism_config_dp_shard_size 2 --parallelism_config_tp_size 2: accelerate launch "
                           "reads the mesh flags only for a config file with a parallelism_config section")
    (said,) = problems("--config_file", tp, "--use_fsdp")
    assert said.startswith("--use_fsdp makes accelerate launch drop the config file's parallelism_config section")
    (said,) = problems("--config_file", ddp, "--cpu")
    assert said.startswith("--cpu makes accelerate launch start one process (its simple launcher), not the 2")
    assert problems("--config_file", tp) == []  # the file's mesh, as accelerate reads it
    assert problems("--config_file", tp, "--parallelism_config_dp_shard_size", "2") == []  # a flag over the section
    assert problems("--config_file", fsdp, "--use_fsdp", "--use_parallelism_config", "--num_processes", "4",
                    "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2") == []
    assert problems("--config_file", ddp, "--cpu", "--num_processes", "1") == []
    launch, _ = launch_settings(["--config_file", ddp, "--cpu", "recipes/tiny.yaml"])
    assert launch["use_cpu"] is True  # --cpu read as use_cpu (the GPU check had refused it: "use_cpu is not set")


def test_what_accelerate_launch_itself_refuses_or_runs_as_one_process_is_said_before_it_starts(tmp_path):
    """accelerate launch's own checks (its _validate_launch_command) came after llmtrain's had passed: a ValueError
    traceback and exit 1; and with no distributed type (no config file on a machine without GPUs) its simple launcher
    started one process where the checks had counted num_processes (audit 34). Each is said with the launch now."""
    from llmtrain.parallel.launch import accelerate_problem

    ddp = str(REPO / "accelerate_configs" / "cpu_ddp.yaml")
    no_count, _ = config(tmp_path, base="cpu_ddp.yaml", num_processes=None)

    def problem(*argv):
        return accelerate_problem([*argv, "recipes/tiny.yaml"], where="the launch")

    assert "(num_processes: N in the file, or --num_processes N)" in problem("--config_file", str(no_count))
    assert "You can only use one of" in problem("--config_file", ddp, "--use_fsdp", "--multi_gpu")
    assert "at least 2 processes to use `--multi_gpu`" in problem("--config_file", ddp, "--multi_gpu",
                                                                   "--num_processes", "1")
    if not __import__("torch").cuda.is_available():  # without GPUs, no config file: accelerate's simple launcher
        assert "asks for 2 processes, and accelerate launch would start one" in problem("--num_processes", "2")
    for argv in (("--config_file", ddp), ("--config_file", str(REPO / "accelerate_configs" / "cpu_fsdp.yaml")),
                 ("--config_file", ddp, "--num_processes", "1", "--cpu"), ()):
        assert problem(*argv) is None, argv


def test_accelerates_pipeline_key_points_to_the_recipes():
    """parallelism_config_pp_size had been refused as pipeline parallelism 'which neither llmtrain nor accelerate
    implements' (a new user's reading: llmtrain has none); llmtrain's is the recipe's key, which the refusal names."""
    (said,) = unhonoured({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
                          "parallelism_config": {"parallelism_config_dp_shard_size": 2,
                                                 "parallelism_config_pp_size": 4}})
    assert "neither llmtrain" not in said and "parallel.pipeline_parallel: 4" in said and "remove the key" in said


def test_a_misspelt_fsdp_version_is_named_and_its_absence_said_as_such(tmp_path):
    """A new user's `fsdp_versoin: 2`: the key is named, and the missing fsdp_version is said to be missing (it used
    to be reported as `fsdp_version: 1`, which the file does not hold)."""
    _, launch = config(tmp_path, fsdp_config={"fsdp_versoin": 2})
    del launch["fsdp_config"]["fsdp_version"]
    problems = unhonoured(launch)
    assert len(problems) == 2 and "fsdp_versoin is not a setting accelerate knows" in problems[0]
    assert problems[1].startswith("fsdp_config has no fsdp_version") and "fsdp_version: 1" not in problems[1]


def test_a_size_of_1_asks_for_nothing_and_is_let_through(tmp_path):
    _, launch = config(tmp_path, parallelism_config={"parallelism_config_dp_shard_size": 2,
                                                     "parallelism_config_pp_size": 1})
    assert unhonoured(launch) == []


def test_the_launch_is_its_config_file_with_the_command_lines_flags_over_it(tmp_path):
    path, _ = config(tmp_path, parallelism_config={"parallelism_config_dp_shard_size": 2})
    launch, where = launch_settings(["--config_file", str(path), "--num_processes", "4",
                                     "--parallelism_config_tp_size", "2", "--dynamo_backend", "inductor",
                                     "recipes/tiny.yaml", "train.max_steps=2"])
    assert where == f"the accelerate config {path} with the command line's flags"  # what the messages name
    assert launch["num_processes"] == 4
    assert launch["parallelism_config"] == {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}
    assert launch["dynamo_config"]["dynamo_backend"] == "inductor"
    assert any("dynamo_backend: inductor" in p for p in unhonoured(launch))
    launch, _ = launch_settings(["--config_file", str(path), "--use_deepspeed", "recipes/tiny.yaml"])
    assert launch["distributed_type"] == "DEEPSPEED"


def test_finetune_options_after_the_recipe_are_not_overrides():
    from llmtrain.launcher import split_finetune_options

    assert split_finetune_options(["train.lr=1e-4", "--resume", "auto", "--overwrite", "x=1"]) == (
        ["train.lr=1e-4", "x=1"], ["--resume", "auto", "--overwrite"])
    assert split_finetune_options(["--resume=runs/a/step_000002"]) == ([], ["--resume=runs/a/step_000002"])


def test_doctor_fails_a_launch_config_with_a_pipeline_it_would_ignore(tiny_assets, tmp_path):
    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    path, _ = config(tmp_path, parallelism_config={"parallelism_config_dp_shard_size": 2,
                                                   "parallelism_config_pp_size": 2})
    got = {name: (status, detail) for name, status, detail in
           run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), accelerate_config=path, gpu_memory=80)}
    assert got["launch settings"][0] == "fail" and "pipeline parallelism" in got["launch settings"][1]
    shipped = {name: status for name, status, _ in run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)),
               accelerate_config=REPO / "accelerate_configs" / "cpu_fsdp.yaml", gpu_memory=80)}
    assert shipped["launch settings"] == "pass"
    # what accelerate launch itself refuses: doctor had passed it as "1 process" (audit 34)
    path, _ = config(tmp_path, name="no-count.yaml", base="cpu_ddp.yaml", num_processes=None)
    got = {name: (status, detail) for name, status, detail in
           run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), accelerate_config=path, gpu_memory=80)}
    assert got["launch settings"][0] == "fail" and "refused by accelerate launch itself" in got["launch settings"][1]


@pytest.mark.parametrize("changes, said", [
    ({"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_pp_size": 2}},
     "pipeline parallelism"),
    ({"parallelism_config": {"parallelism_config_dp_shard_size": 1, "parallelism_config_cp_size": 2}},
     "context parallelism"),
    # accelerate starts num_processes // num_machines a node: 0 (torchrun's AssertionError, exit 1) or too few
    ({"num_processes": 0}, "num_processes 0 over num_machines 1, and accelerate starts num_processes // "
                           "num_machines = 0 on each node"),
    ({"num_machines": 3, "main_process_ip": "127.0.0.1"}, "num_processes 2 over num_machines 3"),
    # accelerate's own refusal had come after llmtrain's checks passed: its ValueError's traceback, exit 1 (audit 34)
    ({"num_processes": None}, "is refused by accelerate launch itself: You need to manually pass in `--num_processes` "
                              "using this config yaml. (num_processes: N in the file, or --num_processes N)"),
])
def test_llmtrain_launch_refuses_before_any_process_starts(tiny_assets, tmp_path, changes, said):
    """exit 2, the paragraph, no torchrun report, and no run folder: the refusal came before `accelerate launch`."""
    path, _ = config(tmp_path, **changes)
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = cli("launch", "--config_file", str(path), "--main_process_port", str(open_port()), str(recipe),
               "train.max_steps=2", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert said in out and out.count("error:") == 1
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert not (tmp_path / "run").exists()


def test_llmtrain_launch_says_the_recipes_and_the_launch_configs_problems_together(tiny_assets, tmp_path):
    """One round of fixes: a misspelt override and a launch setting llmtrain ignores, both in the one error."""
    path, _ = config(tmp_path, fsdp_config={"fsdp_activation_checkpointing": True})
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = cli("launch", "--config_file", str(path), str(recipe), "train.max_stepz=2", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "max_stepz" in proc.stderr and "turn on model.gradient_checkpointing" in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_launch_named_to_resume_a_checkpoint_counts_every_process_it_ran_on(tiny_assets, tmp_path):
    """train_state.json's `processes` are data-parallel ranks: a sequence group's and a pipeline's processes are more
    (a run of 2 on one sequence group had been named `llmtrain finetune`, one process)."""
    import json

    import yaml

    from llmtrain.run.preflight import resume_launch

    recipe = yaml.safe_load(write_recipe(tiny_assets, tmp_path).read_text())
    # a tensor-parallel run's: its TP config and every process (it had been named FSDP's with its data ranks; audit 57)
    for parallel, ranks, sharded, said, tp in [
            ({}, 1, False, "llmtrain finetune", 1), ({}, 2, False, "cpu_ddp.yaml --num_processes 2 ", 1),
            ({"sequence_parallel": 2}, 1, False, "cpu_ddp.yaml --num_processes 2 ", 1),
            ({"pipeline_parallel": 2}, 2, True, "cpu_fsdp.yaml --num_processes 4 ", 1),
            ({}, 2, True, "cpu_tp.yaml --num_processes 4 ", 2)]:
        ckpt = tmp_path / f"ckpt-{len(said)}-{ranks}-{tp}"
        (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True) if sharded else ckpt.mkdir()
        (ckpt / "train_state.json").write_text(json.dumps({"processes": ranks, "tensor_parallel": tp}))
        (ckpt / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "parallel": parallel}))
        assert said in resume_launch(ckpt) and f"{ckpt}/recipe.yaml --resume {ckpt}`" in resume_launch(ckpt)


def test_llmtrain_launch_refuses_a_resume_its_processes_would_refuse_before_any_starts(tiny_assets, tmp_path):
    """A checkpoint written by one process (no FSDP) resumed under an FSDP launch (the newest, or one named), and a
    finished run that kept no checkpoint given more steps: each said once, exit 2, before accelerate launch (which
    had started 2 processes that each found it), and the run folder as it was."""
    kept = write_recipe(tiny_assets, tmp_path, name="kept.yaml", train={"max_steps": 2},
                        checkpoint={"every_steps": 2}, output_dir=str(tmp_path / "kept"))
    bare = write_recipe(tiny_assets, tmp_path, name="bare.yaml", train={"max_steps": 2},
                        output_dir=str(tmp_path / "bare"))
    for recipe in (kept, bare):
        cli("finetune", str(recipe))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    fsdp = str(REPO / "accelerate_configs" / "cpu_fsdp.yaml")
    # (the way back named the launch for CPUs too: it had named accelerate launch with a GPU config, audit 12)
    for args, said in [((fsdp, kept, "train.max_steps=4", "--resume", "auto", "--allow-recipe-change"),
                        "was written without FSDP and this launch uses it. Resume it under the launch that wrote it: "
                        f"`llmtrain finetune {tmp_path / 'kept' / 'checkpoints' / 'step_000002'}/recipe.yaml --resume "
                        f"{tmp_path / 'kept' / 'checkpoints' / 'step_000002'}`"),
                       ((fsdp, kept, "--resume", str(tmp_path / "kept" / "checkpoints" / "step_000002")),
                        "was written without FSDP and this launch uses it"),
                       ((str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), bare, "train.max_steps=4", "--resume",
                         "auto", "--allow-recipe-change"), "kept no checkpoint")]:
        proc = cli("launch", "--config_file", args[0], str(args[1]), *args[2:], check=False)
        assert proc.returncode == 2 and said in " ".join(proc.stderr.split()), proc.stderr
        assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
        assert "what each said is above" not in proc.stderr  # (the launcher's line once processes stopped)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("args, said", [(["train.max_stepz=2"], "max_stepz"),
                                        (["--resume", "RUN/checkpoints/step_2"], "'RUN/checkpoints/step_2' does not "
                                         "exist; RUN/checkpoints holds no checkpoint")],
                         ids=["override", "resume"])
def test_llmtrain_launch_refuses_a_bad_override_or_resume_before_any_process_starts(tiny_assets, tmp_path, args,
                                                                                     said):
    recipe = write_recipe(tiny_assets, tmp_path)
    run = str(tmp_path / "run")
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), str(recipe),
               *[a.replace("RUN", run) for a in args], check=False)
    assert proc.returncode == 2 and said.replace("RUN", run) in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_llmtrain_launch_runs_accelerate_launch_when_the_checks_pass(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port",
               str(open_port()), str(recipe), "train.max_steps=2", "--overwrite")
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2], proc.stdout[-2000:]
    assert "2 processes" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow
def test_a_run_that_stops_under_llmtrain_launch_says_why_and_not_torchruns_traceback(tiny_assets, tmp_path):
    """What only the processes can find (here a data row that is not JSON: the launch reads the recipe, not the data)
    is said in each one's paragraph; torchrun's report (a 40-line ChildFailedError traceback) is one line naming the
    processes; the exit status is the processes' own (2: a refusal)."""
    data = tmp_path / "bad.jsonl"
    data.write_text((tiny_assets / "data" / "train.jsonl").read_text() + "{not json\n")
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data)})
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port",
               str(open_port()), str(recipe), "train.max_steps=2", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert "bad.jsonl" in said and "Traceback" not in said and "ChildFailedError" not in said, said[-3000:]
    assert "traceback of its own" not in said  # plain accelerate launch's word on torchrun's report: none here
    assert re.search(r"llmtrain launch: process(es)? 0 \(exit status 2\).* stopped.*; what each said is above", said)
    assert said.count("error:") == 1  # the main process's paragraph; the other had it handed (errors.Relayed)
    assert "torch/distributed/elastic" not in said  # torchrun's W/E log lines beside the one line (audit 34)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_data_check_every_process_fails_alike_is_said_once(tiny_assets, tmp_path):
    """A check of the data (here GRPO's prompt room: no room left for rl.max_completion_tokens) runs on every process
    once the process group exists, each on the same data: each printed the same paragraph (2 copies on 2 processes,
    4 under cpu_tp.yaml). It is said once a node now (errors.Everywhere), and the exit status is still 2."""
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port",
               str(open_port()), str(_grpo_recipe(tiny_assets, tmp_path)), "rl.max_completion_tokens=64",
               "data.max_seq_len=64", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert said.count("error: prompt room:") == 1 and "Traceback" not in said, said[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_one_process_launched_alone_that_stops_says_why_and_not_accelerates_traceback(tiny_assets, tmp_path):
    """A launch of one process without torchrun (accelerate's simple launcher: a single-GPU config) reports a
    failed process as a CalledProcessError traceback; what llmtrain launch runs (llmtrain.launcher) says the one
    line and exits with the process's status."""
    data = tmp_path / "bad.jsonl"
    data.write_text((tiny_assets / "data" / "train.jsonl").read_text() + "{not json\n")
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data)})
    proc = subprocess.run([sys.executable, "-m", "llmtrain.launcher", "--cpu", "--num_processes", "1", "-m",
                           "llmtrain", "finetune", str(recipe), "train.max_steps=2"], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "bad.jsonl" in said and "Traceback" not in said, said[-3000:]
    assert "llmtrain launch: process 0 (exit status 2) stopped; what it said is above" in said


@pytest.mark.slow
def test_finetune_under_a_plain_accelerate_launch_refuses_what_accelerate_ignores(tiny_assets, tmp_path):
    """The pipeline key never reaches the processes' environment: each finds it in its launcher's command line and
    config file, and refuses before it writes anything."""
    path, _ = config(tmp_path, parallelism_config={"parallelism_config_dp_shard_size": 2,
                                                   "parallelism_config_pp_size": 2})
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path),
                           "--main_process_port", str(open_port()), "-m", "llmtrain", "finetune", str(recipe),
                           "train.max_steps=2"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "parallelism_config_pp_size: 2 asks accelerate for pipeline parallelism" in said
    # torchrun's traceback follows; one line, once, says it is only the launcher's report and names llmtrain launch
    assert said.count("reports the failed processes below with a traceback of its own") == 1, said[-3000:]
    assert said.index("asks accelerate for pipeline parallelism") < said.index("`llmtrain launch` takes") < \
        said.index("Traceback")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_llmtrain_launch_refuses_more_gpu_processes_than_this_machine_has_gpus(tiny_assets, tmp_path):
    """A GPU config (use_cpu unset) on a machine with fewer GPUs: accelerate would start every process on the CPU.
    Refused before any process starts, naming the counts and the CPU configs; a CPU config is let through."""
    from llmtrain.parallel.launch import gpus_problem

    gpu, _ = config(tmp_path, use_cpu=False, num_processes=8)
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = cli("launch", "--config_file", str(gpu), str(recipe), "train.max_steps=2", check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and out.count("error:") == 1 and "Traceback" not in out, out
    assert "starts 8 processes on this machine, one a GPU" in out and "cpu_fsdp.yaml" in out
    assert not (tmp_path / "run").exists()
    launch = {"num_processes": 16, "num_machines": 2}
    assert "starts 8 processes" in gpus_problem(launch, where="x", gpus=4)
    assert "lower --num_processes to 4" in gpus_problem(launch, where="x", gpus=4)
    # a config file's: one process is finetune's (--cpu beside it had been said, then refused; audit 48)
    assert "--cpu" not in gpus_problem(launch, where="x", gpus=0) and "`llmtrain finetune RECIPE.yaml` (one process" \
        in gpus_problem(launch, where="x", gpus=0)
    assert gpus_problem(launch, where="x", gpus=8) is None
    assert gpus_problem({**launch, "use_cpu": True}, where="x", gpus=0) is None
    one = gpus_problem({"num_processes": 1}, where="x", gpus=0)  # said in the singular ("there are 1 GPUs" before)
    assert "starts 1 process on this machine" in one and "Run it where there is 1 GPU," in one
    # no config file: accelerate's defaults, not a "use_cpu" the user never wrote, and --cpu named (audit 36)
    bare = gpus_problem({}, where="the accelerate launch", gpus=0)
    assert bare.startswith("without a config file, accelerate launch's defaults start 1 process") and "--cpu (one" \
        in bare, bare


def test_llmtrain_launch_says_a_missing_model_once_before_any_process_starts(tiny_assets, tmp_path):
    """Each process would fail to find it and torchrun would report them all; launch reads the config and the
    tokenizer first."""
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), str(recipe),
               f"model.name_or_path={tmp_path / 'no-such-model'}", check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and out.count("error:") == 1 and "ChildFailedError" not in out, out
    assert f"'{tmp_path / 'no-such-model'}'" in out and "does not exist" in out
    assert not (tmp_path / "run").exists()


def _without_weights(tiny_assets, tmp_path):
    import shutil

    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_assets / "model", folder)
    (folder / "model.safetensors").unlink()
    return folder


@pytest.mark.parametrize("key", ["model.name_or_path", "distill.teacher"])
def test_llmtrain_launch_says_a_model_folder_without_weights_once_before_any_process_starts(tiny_assets, tmp_path,
                                                                                             key):
    """A folder with a config and no weights: each process had said it (the student under DDP), or under FSDP the
    main process alone, the others dying in the broadcast it never reached (audit 34); launch reads the file names."""
    folder = _without_weights(tiny_assets, tmp_path)
    path = _shipped(tiny_assets, tmp_path, "tiny-distill", teacher=tiny_assets / "model")
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_fsdp.yaml"), str(path),
               f"{key}={folder}", check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and out.count("error:") == 1 and "ChildFailedError" not in out, out
    assert f"the model folder '{folder}' ({key}" in out and "has a config.json but no weights" in out, out
    assert "llmtrain launch: process" not in out  # no process started (the launcher's word on failed ones)
    assert not (tmp_path / "run").exists()


def _shipped(tiny_assets, tmp_path, name: str = "tiny-grpo", teacher=None):
    """recipes/NAME.yaml on the test's tiny model and data (no eval), its teacher `teacher`'s where it has one."""
    recipe = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    recipe["data"].update(path=str(tiny_assets / "data" / "train.jsonl"), eval_split=None)
    recipe["model"]["name_or_path"] = str(tiny_assets / "model")
    if teacher is not None:
        recipe["distill"]["teacher"] = str(teacher)
    recipe["output_dir"] = str(tmp_path / "run")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _grpo_recipe(tiny_assets, tmp_path):
    return _shipped(tiny_assets, tmp_path)


@pytest.mark.parametrize("rl, overrides, said", [
    (False, ["lora.r=4", "lora.target_modules=[q_proj,vproj]"],
     "lora.target_modules names vproj, which no module of this model is called"),
    pytest.param(False, ["model.kernels=liger"], "model.kernels=liger needs liger-kernel and a CUDA device",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU launch's")),
    (False, ["eval.tasks=[tiny_reverse]", "checkpoint.save_final=false"],
     "eval: scores final/, and checkpoint.save_final is false"),
    pytest.param(False, ["logging.report_to=[tensorboard]"], "the tensorboard package is not installed",
                 marks=pytest.mark.skipif(__import__("importlib").util.find_spec("tensorboard") is not None,
                                          reason="tensorboard is installed here")),
    (True, ["rl.rewards=[{type: function, function: 'no_such_module_x:fn'}]"],
     "reward function 'no_such_module_x:fn': importing no_such_module_x failed"),
    (True, ["rl.tools=[no_such_module_y:lookup]"], "the tool 'no_such_module_y:lookup' cannot be imported"),
])
def test_what_every_process_would_refuse_after_loading_is_said_by_launch_before_any_starts(tiny_assets, tmp_path,
                                                                                           rl, overrides, said):
    """Each had been refused by every process once the processes ran (most once per process), a LoRA target's typo
    and liger after the whole model loaded (audit 34): launch finds them from the model's config on the meta device,
    the packages installed and the user's modules."""
    recipe = _grpo_recipe(tiny_assets, tmp_path) if rl else write_recipe(tiny_assets, tmp_path)
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), str(recipe), *overrides,
               check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and out.count("error:") == 1 and said in out, out
    assert "llmtrain launch: process" not in out and "Traceback" not in out, out  # no process started
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_recipes_eval_that_cannot_run_is_said_once_by_processes_started_without_launchs_checks(tiny_assets,
                                                                                                  tmp_path):
    """A plain accelerate launch (llmtrain.launcher, without llmtrain launch's checks): every process checks the same
    eval: section and had printed the same paragraph, once a process (audit 34); said once a node now."""
    proc = subprocess.run([sys.executable, "-m", "llmtrain.launcher", "--config_file",
                           str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port", str(open_port()),
                           "-m", "llmtrain", "finetune", str(write_recipe(tiny_assets, tmp_path)),
                           "eval.tasks=[tiny_reverse]", "checkpoint.save_final=false"],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and said.count("checkpoint.save_final is false") == 1, said[-3000:]


@pytest.mark.slow
def test_an_output_dir_the_main_process_refuses_is_said_once_under_a_plain_accelerate_launch(tiny_assets, tmp_path):
    """The main process checks output_dir and hands its refusal to the others: each had printed it again (audit 36),
    where docs/launch.md says once."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "llmtrain.launcher", "--config_file",
                           str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port", str(open_port()),
                           "-m", "llmtrain", "finetune", str(write_recipe(tiny_assets, tmp_path))],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and said.count("error:") == 1 and "notes.txt" in said, said[-3000:]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_doctor_fails_a_lora_target_no_module_has_and_a_recipes_eval_that_cannot_run(tiny_assets, tmp_path):
    """Doctor had passed both, which every process then refused (audit 34)."""
    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    recipe = load_recipe(write_recipe(tiny_assets, tmp_path), [
        "lora.r=4", "lora.target_modules=[q_proj,vproj]", "eval.tasks=[tiny_reverse]", "checkpoint.save_final=false"])
    got = {name: (status, detail) for name, status, detail in run_doctor(recipe, gpu_memory=80)}
    assert got["LoRA targets"][0] == "fail" and "names vproj, which no module" in got["LoRA targets"][1]
    assert got["run needs"][0] == "fail" and "checkpoint.save_final is false" in got["run needs"][1]
    fine = {name: status for name, status, _ in run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path),
                                                                       ["lora.r=4"]), gpu_memory=80)}
    assert fine["LoRA targets"] == "pass" and "run needs" not in fine


def test_a_teacher_whose_heads_do_not_split_over_the_sequence_group_is_refused_before_any_process_starts(
        tiny_assets, tmp_path):
    """Under sequence parallelism the teacher attends through the group's all-to-all: heads that do not split had
    been refused by every process after both models loaded (audit 34); launch and doctor read its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.update({"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 32})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "teacher3")
    AutoTokenizer.from_pretrained(tiny_assets / "model").save_pretrained(tmp_path / "teacher3")
    path = _shipped(tiny_assets, tmp_path, "tiny-distill", teacher=tmp_path / "teacher3")
    proc = cli("launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), str(path),
               "parallel.sequence_parallel=2", check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and out.count("error:") == 1 and "llmtrain launch: process" not in out, out
    assert f"the teacher {tmp_path / 'teacher3'}: parallel.sequence_parallel=2: its 3 attention heads" in out, out
    got = {name: (status, detail) for name, status, detail in
           run_doctor(load_recipe(path, ["parallel.sequence_parallel=2"]), gpu_memory=80)}
    assert got["teacher"][0] == "fail" and "its 3 attention heads" in got["teacher"][1]


@pytest.mark.slow
def test_a_model_the_main_process_alone_cannot_read_under_fsdp_is_its_paragraph_not_the_others_traceback(
        tiny_assets, tmp_path):
    """Under FSDP the main process reads the weights and the others build an empty model for prepare's broadcast:
    its refusal had been its paragraph and, on the other process, 60 lines of gloo's "Connection closed by peer"
    (audit 34). The processes agree on the load's outcome (collectives.agreed) before any goes on. Launched without
    llmtrain launch's checks (llmtrain.launcher), as a plain accelerate launch is."""
    folder = _without_weights(tiny_assets, tmp_path)
    recipe = write_recipe(tiny_assets, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "llmtrain.launcher", "--config_file",
                           str(REPO / "accelerate_configs" / "cpu_fsdp.yaml"), "--main_process_port", str(open_port()),
                           "-m", "llmtrain", "finetune", str(recipe), f"model.name_or_path={folder}",
                           "train.max_steps=1"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert said.count("has a config.json but no weights") == 1, said[-3000:]
    assert "Traceback" not in said and "Connection closed" not in said, said[-3000:]


@pytest.mark.parametrize("args, said", [([], "no recipe given"), (["--bogus", "recipes/tiny.yaml"],
                                                                   "unrecognized arguments: --bogus")])
def test_llmtrain_launch_without_a_recipe_or_with_an_unknown_flag_says_so_in_one_paragraph(args, said):
    """Not accelerate's 130-line usage: the problem, and how llmtrain launch is called."""
    proc = cli("launch", *args, check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and said in out and "llmtrain launch takes accelerate launch's flags" in out, out
    assert "usage:" not in out and len(out) < 600


def test_an_accelerate_config_that_cannot_be_read_says_how_to_fix_it(tmp_path):
    """A missing file had been "[Errno 2] No such file or directory" and one that is not YAML PyYAML's three-line
    excerpt, neither saying what to give (audit 46)."""
    (tmp_path / "bad.yaml").write_text("distributed_type: [MULTI_GPU\n")
    for config, said in ((tmp_path / "nocfg.yaml", "No such file or directory. Give the path of an accelerate config"),
                         (tmp_path / "bad.yaml", "is not valid YAML at line 2, column 1")):
        proc = cli("launch", "--config_file", str(config), "recipes/tiny.yaml", check=False)
        out = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode == 2 and said in out and "accelerate_configs/" in out, out
        assert "Traceback" not in out


def test_the_launcher_gives_its_processes_time_to_save_a_stop_before_torchrun_kills_them(monkeypatch):
    """torchrun kills the processes TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default) after it passed them a
    SIGTERM or Ctrl-C: a 2-process run stopped in a 30 s eval was killed before the checkpoint its stop promised
    (audit 54). llmtrain launch sets 300 where it is unset, keeps a user's value, and says it on a stop."""
    import signal

    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from llmtrain import launcher

    seen = []

    def stopped(args):
        seen.append(launcher.os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
        raise SignalException("stop", sigval=signal.SIGTERM)

    monkeypatch.setattr(accelerate_launch, "launch_command", stopped)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    argv = ["--config_file", str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "-m", "llmtrain", "finetune", "r.yaml"]
    assert launcher.launched(argv) == 143 and seen == ["300"]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert launcher.launched(argv) == 143 and seen == ["300", "45"]
