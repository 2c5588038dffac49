"""A rank's process groups end with its run (issue 31): once `torchtitan.train.main` returns, no gloo thread is left.

torch's DTensor caches keep every DeviceMesh they planned for, and a mesh keeps its process groups, so after
destroy_process_group a gloo group's transport loop and workers ran on through the interpreter's exit, where a
worker's late release of a tensor aborts the rank (scripts/diagnostics/gloo_exit_probe.py), and, in a process
that goes on, one set stayed per run. distributed/utils.end_distributed lets go of those caches.
"""

import os

import pytest

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.distributed

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def _threads() -> list[str]:
    task = f"/proc/{os.getpid()}/task"
    names = []
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while listing
            pass
    return sorted(names)


def _train_then_list_threads(rank, world_size, dump_folder):
    from torchtitan.train import main

    during = _threads()  # the test harness's group is up: gloo's threads exist, so the names are right
    code = main(["--model.flavor", "debugmodel_tiny", "--training.steps", "1", "--training.seq_len", "64",
                 "--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2",
                 "--validation.enable", "false", "--metrics.log_freq", "1", "--job.dump_folder", dump_folder])
    return code, during, _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from /proc")
def test_no_gloo_thread_outlives_the_run(tmp_path):
    for code, during, after in run_ranks(_train_then_list_threads, 2, str(tmp_path)):
        assert code == 0
        assert any(name in GLOO_THREADS for name in during), during
        assert not [name for name in after if name in GLOO_THREADS], after
