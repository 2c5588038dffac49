"""Retention with milestones on a real run (one process, the tiny fixture model): a SIGKILL in the middle of a
removal loses nothing that should be kept and the next start finishes the removal; then keep-latest 2 + every
5th over a 12-step run with async saves every step (each removal pass runs while the next save is being
written) leaves exactly the expected steps. On a local folder and on the S3 server (the `store` fixture): the
same steps are kept; on the store a removal deletes the manifest first (no rename), and a LATEST pointer
object sits beside the version store."""

import json
import os
import signal
import subprocess
import sys

from tests.unit.checkpoint_helpers import TINY, run
from torchtitan.tools import storage
from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.manager import RUN_RECORD

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_v0", "bytes.tiktoken")
RETAIN = ["--model.tokenizer_path", TOKENIZER, "--checkpoint.enable", "--checkpoint.interval", "1",
          "--checkpoint.keep_latest_k", "2", "--checkpoint.keep_every_n_steps", "5"]


def listing(root) -> list[str]:
    return storage.listdir(str(root))


def test_keep_latest_two_and_every_fifth_survives_a_kill_in_a_removal(tmp_path, store):
    """A run is SIGKILLed while retention removes step-2 (renamed, not yet deleted); its rerun, 12 steps with
    async saves every step (8 more saves, two milestones among them), finishes that removal first and ends with
    exactly the expected steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCHTITAN_FAULTS": json.dumps([{"kind": "kill_in_removal", "step": 2}])}
    argv = [*TINY, *RETAIN, *store.argv, "--training.steps", "12", "--job.dump_folder", str(tmp_path)]
    killed = subprocess.run([sys.executable, "-m", "torchtitan.train", *argv], env=env, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    root = store.root(tmp_path)
    if store.kind == "local":
        assert "step-2.reclaiming" in listing(root)  # killed between the rename and the delete
    else:  # killed between deleting the manifest (it can never look complete again) and deleting the rest
        assert "step-2" in listing(root) and "no manifest.json" in folders.problem(storage.join(root, "step-2"))
    assert folders.read_store(str(root))["removing"] == ["step-2"]
    assert {3, 4} <= set(folders.named_steps(str(root)))  # what the pass keeps is untouched

    assert run(tmp_path, *RETAIN, *store.argv, "--checkpoint.async_mode", "async", "--training.steps", "12") == 0
    kept = (5, 10, 11, 12)
    extra = [folders.VERSIONS] + ([folders.LATEST, RUN_RECORD] if store.kind == "s3" else [])
    assert listing(root) == sorted([f"step-{s}" for s in kept] + extra)  # no .reclaiming left
    for step in kept:
        assert folders.problem(storage.join(root, f"step-{step}")) is None
    store = folders.read_store(str(root))
    assert store["removing"] == [] and sorted(v["step"] for v in store["versions"].values()) == list(kept)
