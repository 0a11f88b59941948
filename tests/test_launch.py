"""The launch scripts: real torchrun processes, two 'nodes' on loopback (tests/test_network.py: in namespaces of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import netns
import pytest
from conftest import REPO, base_config, free_port, wait_for, write_config

ENV = {**os.environ, "PYTHON": sys.executable}


def _config(tmp_path, tiny_model_dir, **train):
    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 3, "micro_batch_size": 2, **train})
    return str(write_config(tmp_path / "c.yaml", cfg))


@pytest.mark.parametrize("script", ["single_node.sh", "multi_node.sh", "slurm.sbatch"])
def test_help(script):
    result = subprocess.run(["bash", f"launch/{script}", "--help"], cwd=REPO, capture_output=True, text=True, env=ENV)
    assert result.returncode == 0 and "usage:" in result.stdout


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_single_node_script_starts_two_processes(tmp_path, tiny_model_dir, launcher):
    """`torchrun ... finetune/train.py` and `accelerate launch ... finetune/train.py` (the commands the script prints
    and runs): two processes that train together, their replicas equal, only rank 0 reporting."""
    cmd = ["bash", "launch/single_node.sh", "--nproc", "2", "--launcher", launcher, "--port", str(free_port()),
           "--", "--config", _config(tmp_path, tiny_model_dir, grad_accum=2)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"launch: {sys.executable} -m {'torch.distributed.run' if launcher == 'torchrun' else 'accelerate.commands.launch'}" in result.stderr
    assert "finetune/train.py --config" in result.stderr  # the exact command is printed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True
    assert "= 8 rows per step" in result.stdout  # 2 micro x 2 accum x 2 processes
    assert result.stdout.count("done: 3 steps") == 1  # only rank 0 reports


@pytest.mark.skipif(netns.refusal() is None, reason="tests/test_network.py launches two nodes with multi_node.sh over network stacks of their own")
def test_two_nodes_on_loopback_train_together(tmp_path, tiny_model_dir):
    """Where this machine makes no network namespaces: two nodes of multi_node.sh on loopback train together."""
    port, config = free_port(), _config(tmp_path, tiny_model_dir)
    cmd = ["bash", "launch/multi_node.sh", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-host", "127.0.0.1",
           "--rdzv-port", str(port), "--rdzv-id", f"test-{port}", "--", "--config", config]
    nodes = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True


def test_slurm_script_takes_the_rendezvous_from_slurm(tmp_path):
    env = {**ENV, "DRY_RUN": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a,gpu-b", "SLURM_NNODES": "2"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    result = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "configs/lora.yaml"], cwd=REPO, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "--nnodes 2" in result.stderr and "--rdzv_endpoint gpu-a:24242" in result.stderr and "--rdzv_id 4242" in result.stderr


def test_an_elastic_slurm_job_and_a_job_that_gives_it_a_node_back_share_one_rendezvous():
    env = {k: v for k, v in ENV.items() if not k.startswith("MASTER_")}
    env.update(DRY_RUN="1", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a,gpu-b,gpu-c", SLURM_NNODES="3", MIN_NODES="2")
    job = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "configs/lora.yaml"], cwd=REPO, capture_output=True, text=True, env=env)
    env.update(SLURM_JOB_ID="5000", SLURM_JOB_NODELIST="gpu-d", SLURM_NNODES="1", JOIN_JOB="4242", JOIN_NODELIST="gpu-a,gpu-c", MAX_NODES="3")
    joining = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "configs/lora.yaml"], cwd=REPO, capture_output=True, text=True, env=env)
    for result in (job, joining):
        assert result.returncode == 0, result.stderr
        assert "srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0" in result.stderr
        assert "--nnodes 2:3" in result.stderr and "--rdzv_endpoint gpu-a:24242 --rdzv_id 4242 --max_restarts 100" in result.stderr
    env.pop("MAX_NODES")
    refused = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "configs/lora.yaml"], cwd=REPO, capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "JOIN_JOB needs MAX_NODES" in refused.stderr


def test_slurm_dry_run_prints_the_commands_and_starts_nothing(tmp_path):
    """Outside Slurm too: the srun line and the torchrun command it leads to, with stand-ins for the allocation."""
    env = {k: v for k, v in ENV.items() if not k.startswith(("SLURM_", "MASTER_"))}
    result = subprocess.run(["bash", "launch/slurm.sbatch", "--dry-run", "--config", str(tmp_path / "missing.yaml")], cwd=REPO,
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("slurm: srun --ntasks-per-node=1 bash") for line in lines)
    assert any(line.startswith("launch: ") and "torch.distributed.run" in line and "--dry-run" not in line for line in lines)
    assert "error" not in result.stderr.lower() and not (tmp_path / "missing.yaml").exists()  # no torchrun, no training started


def test_a_preempted_job_ends_with_75_through_the_launch_script(tmp_path, tiny_model_dir):
    """torchrun itself exits 1 when its workers stop with 75; the script exits with the run's own code,
    which is what a scheduler requeues on."""
    import signal

    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 2000, "micro_batch_size": 2})
    cmd = ["bash", "launch/single_node.sh", "--nproc", "2", "--", "--config", str(write_config(tmp_path / "c.yaml", cfg))]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    metrics = tmp_path / "out" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, job, "5 logged steps")
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, (job.returncode, stderr[-3000:])
    assert stderr.count("error: preempted at step") == 2
    assert len(list((tmp_path / "out" / "checkpoints").glob("step-*"))) == 2  # the start's and the preemption's


def test_a_second_launch_of_a_running_job_is_refused_in_one_line_before_the_rendezvous(tmp_path, tiny_model_dir):
    from finetune.checkpoint.locks import hold_output_dir, release_output_dir

    config = _config(tmp_path, tiny_model_dir)
    (tmp_path / "out").mkdir()
    lock = hold_output_dir(tmp_path / "out", say=lambda _: None)  # the first launch's rank 0, still running
    try:
        cmd = ["bash", "launch/multi_node.sh", "--nnodes", "1", "--rdzv-port", str(free_port()), "--", "--config", config]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    finally:
        release_output_dir(lock)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"is in use by another run (pid {os.getpid()} on" in lines[0], lines
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
