"""Checkpoint content checksums and the manifest's format version, in one process on the tiny fixture model:
an old checkpoint (format 1, written before checksums existed) still resumes bitwise; a new one records a
CRC-32 per file computed while writing, and a byte changed on disk (size unchanged) is refused with the file's
name, the folder kept, the previous checkpoint used (on a local folder and on the S3 server); a newer format than
the code knows is refused in one line."""

import json
import os
import shutil

from tests.unit.checkpoint_helpers import losses, run
from torchtitan.tools import storage
from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.checksums import file_checksum

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_v0")
with open(os.path.join(FIXTURE, "expected.json")) as f:
    EXPECTED = json.load(f)
ARGS = [a if not a.endswith(".tiktoken") else os.path.join(FIXTURE, "bytes.tiktoken") for a in EXPECTED["args"]]
# The fixture was written when a flavor's vocabulary shrank to the tokenizer's (256 rows); the flavor now keeps
# its own 2,048 (protocols/model.py job_vocab_size), so the old run's shape is given explicitly.
ARGS += ["--model.overrides", "vocab_size=256"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def expected(steps) -> list[float]:
    return [EXPECTED["losses_by_step"][str(s)] for s in steps]


def test_old_checkpoint_resumes_bitwise_then_checksums_guard_the_new_ones(tmp_path, capsys, caplog):
    root = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(FIXTURE, "checkpoint"), root)
    old = str(root / "step-2")
    assert "format_version" not in folders.read_manifest(old)  # really the old format
    assert run(tmp_path, *ARGS, *CKPT) == 0  # 4 steps, resumed from the old step-2
    assert losses(tmp_path) == expected([3, 4])  # the old code's uninterrupted run, bitwise
    assert f"Resumed from {old}" in caplog.text
    caplog.clear()

    # The new save: format 2, a checksum for every file, equal to its content's (computed while writing).
    new = str(root / "step-4")
    manifest = folders.read_manifest(new)
    assert manifest["format_version"] == folders.FORMAT_VERSION == 2
    assert set(manifest["checksums"]) == set(manifest["files"]) == set(os.listdir(new)) - {folders.MANIFEST}
    assert "checksums_read_back" not in manifest  # every file was hashed on its way to disk
    for name, recorded in manifest["checksums"].items():
        assert file_checksum(os.path.join(new, name)) == recorded, name
    assert not [n for n in os.listdir(new) if n.startswith("checksums-rank-")]  # folded into the manifest

    # One byte changed in the middle of the data file, the size unchanged: the sizes alone would accept it.
    data = os.path.join(new, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    assert folders.problem(new) is None
    os.remove(tmp_path / "metrics.jsonl")
    assert run(tmp_path, *ARGS, *CKPT) == 0
    err = caplog.text
    assert f"Skipping checkpoint {root}/step-4: file __0_0.distcp does not match its checksum" in err, err[-2000:]
    assert f"Resumed from {old}" in err
    assert losses(tmp_path) == expected([3, 4])  # steps 3 and 4 trained again from step-2
    kept = [n for n in os.listdir(root) if n.startswith("step-4.old-")]  # the new step-4 moved it aside, intact
    assert len(kept) == 1 and os.path.getsize(root / kept[0] / "__0_0.distcp") == size

    capsys.readouterr()
    # A newer format than this code knows: refused in one line, nothing resumed, nothing removed.
    newest = root / "step-4" / folders.MANIFEST
    manifest = json.loads(newest.read_text())
    newest.write_text(json.dumps({**manifest, "format_version": 99}))
    assert run(tmp_path, *ARGS, *CKPT) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "checkpoint format 99 was written by a newer torchtitan" in errors[0], errors
    assert "step-4" in os.listdir(root)


def test_changed_byte_is_refused_and_the_previous_used(tmp_path, store, caplog):
    """On a local folder and on the S3 server: a byte of the newest checkpoint's data changed after the save
    (same size, so only its checksum can tell) is refused with the file's name, the previous checkpoint is
    used, steps 3-4 train again to the same losses, and the refused folder is kept aside, not deleted."""
    tiny = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4", "--training.mixed_precision_param", "float32",
            "--training.steps", "4", *CKPT, *store.argv]
    assert run(tmp_path, *tiny) == 0
    first = losses(tmp_path)
    root = store.root(tmp_path)
    data = storage.join(root, "step-4", "__0_0.distcp")
    content = bytearray(storage.read_bytes(data))
    content[len(content) // 2] ^= 0x01
    storage.write_bytes(data, bytes(content))
    assert folders.problem(storage.join(root, "step-4")) is None  # the sizes alone accept it
    os.remove(tmp_path / "metrics.jsonl")
    assert run(tmp_path, *tiny) == 0
    assert f"Skipping checkpoint {root}/step-4: file __0_0.distcp does not match its checksum" in caplog.text
    assert f"Resumed from {root}/step-2" in caplog.text
    assert losses(tmp_path) == first[2:]
    aside = [n for n in storage.listdir(root) if n.startswith("step-4.old-")]
    assert len(aside) == 1 and storage.read_bytes(storage.join(root, aside[0], "__0_0.distcp")) == bytes(content)
    assert folders.problem(storage.join(root, "step-4")) is None  # the new save of step 4
