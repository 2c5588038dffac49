"""scripts/slurm/multinode_trainer.slurm on a real Slurm: a cluster of 2 emulated nodes on this host (munged,
slurmctld and 2 slurmd from a generated slurm.conf, see tests/slurm_cluster.py) runs the project's sbatch
script for the debug recipe (tiny flavor, fp32, 4 steps), 1 process per node.

Checks what a user checks: the job COMPLETED with exit code 0, its metrics.jsonl has every step with finite
losses that match a single-process run of the same global batch (within the 2D-parity tolerances: the job
trains FSDP over 2 ranks), its output and rank logs are named by job id, and the restart budget reached
torchrun. Skips when Slurm or munge is missing (scripts/slurm/ensure_slurm.sh installs them on CI) or not root.
"""

import json
import math
import os
import re
import subprocess
import time

import pytest

from tests.multiprocess import free_port
from tests.slurm_cluster import missing_programs, slurm_cluster

pytestmark = pytest.mark.slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = "train_configs/debug_model.toml"
TRAINER_ARGS = [
    "--model.flavor", "debugmodel_tiny",  # the parity tolerances are set for it (debugmodel's grad norm: 9e-5)
    "--training.steps", "4",
    "--training.seq_len", "64",
    "--training.global_batch_size", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--validation.enable", "false",
    "--metrics.log_freq", "1",
    "--debug.deterministic",
]  # fmt: skip


def _skip_reason() -> str | None:
    missing = missing_programs()
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}; scripts/slurm/ensure_slurm.sh installs them)"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd)"
    return None


def _logged_steps(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def _wait_for_job(job_id: str, env: dict, timeout: float) -> dict:
    """Waits until the job leaves the queue; returns `scontrol show job` as a dict."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True)
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        if fields.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return fields
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=env)
    raise AssertionError(f"job {job_id} did not finish within {timeout:.0f}s")


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_sbatch_script_trains_the_debug_model_on_two_nodes(tmp_path):
    from tests.distributed.test_parity_2d import assert_parity
    from tests.distributed.trainer_runs import curves
    from torchtitan.train import main

    dump = tmp_path / "run"
    with slurm_cluster(str(tmp_path / "cluster"), nodes=2, cpus=2) as env:
        env = {**env, "CONFIG_FILE": RECIPE, "NPROC_PER_NODE": "1", "MAX_RESTARTS": "1",
               "MASTER_PORT": str(free_port()), "LOG_DIR": str(tmp_path / "logs"), "OMP_NUM_THREADS": "1"}
        submit = subprocess.run(
            ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
             f"--output={tmp_path}/slurm-%x-%j.out", "scripts/slurm/multinode_trainer.slurm",
             *TRAINER_ARGS, "--training.local_batch_size", "2", "--job.dump_folder", str(dump)],
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        job = _wait_for_job(job_id, env, timeout=420)
    output = (tmp_path / f"slurm-torchtitan-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert "2 node(s) x 1 process(es)" in output, output
    assert (job["NumNodes"], job["NodeList"]) == ("2", "node[1-2]")
    assert "max restarts 1" in output, output
    # Restarts are the supervisor's (torchtitan.tools.restart); each node's torchrun makes one attempt.
    assert len(re.findall(r"max_restarts\s*: 0\n", output)) == 2, output
    rank_logs = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "logs" / job_id) for f in files]
    assert any(p.endswith("stdout.log") for p in rank_logs), "torchrun keeps each rank's output under LOG_DIR/JOBID"

    steps = _logged_steps(dump)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(m["loss"]) for m in steps)
    # The same recipe in one process (global batch 4 on one rank): the job's 2 ranks trained the same model.
    assert main(["--job.config_file", os.path.join(REPO, RECIPE), *TRAINER_ARGS, "--training.local_batch_size", "4",
                 "--job.dump_folder", str(tmp_path / "single")]) == 0
    assert_parity(curves(steps), curves(_logged_steps(tmp_path / "single")))
