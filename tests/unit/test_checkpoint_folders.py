"""The checkpoint folder format: completion manifest, corruption detection, resume choice, retention (the
version store: milestones, readers' leases, interrupted removals)."""

import os

from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.checksums import file_checksum


def fake_checkpoint(root, step, payload=b"x" * 100, complete=True):
    folder = folders.step_folder(str(root), step)
    name = folder if complete else folder + folders.PARTIAL
    os.makedirs(name)
    with open(os.path.join(name, folders.DCP_METADATA), "wb") as f:
        f.write(b"meta")
    with open(os.path.join(name, "__0_0.distcp"), "wb") as f:
        f.write(payload)
    if complete:
        # A stand-in for the writer's checksums (ChecksummingWriter computes them while writing).
        sums = {n: file_checksum(os.path.join(name, n)) for n in os.listdir(name)}
        folders.write_manifest(name, {"step": step}, sums)
    return name


def test_manifest_marks_complete_and_records_code_version(tmp_path):
    folder = fake_checkpoint(tmp_path, 5)
    assert folders.problem(folder) is None
    manifest = folders.read_manifest(folder)
    assert manifest["step"] == 5 and manifest["files"]["__0_0.distcp"] == 100
    assert manifest["torchtitan"] and manifest["torch"]
    assert "git_commit" in manifest


def test_truncated_missing_and_unfinished_are_reported(tmp_path):
    folder = fake_checkpoint(tmp_path, 1)
    with open(os.path.join(folder, "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    assert "has 10 bytes, 100 were written" in folders.problem(folder)
    os.remove(os.path.join(folder, "__0_0.distcp"))
    assert folders.problem(folder) == "missing file __0_0.distcp"
    os.remove(os.path.join(folder, folders.MANIFEST))
    assert "did not finish" in folders.problem(folder)
    # Foreign checkpoints (no manifest) only need DCP's metadata when the manifest is optional.
    assert folders.problem(folder, require_manifest=False) is None


def test_resume_skips_newer_broken_folders_and_partials(tmp_path):
    fake_checkpoint(tmp_path, 5)
    broken = fake_checkpoint(tmp_path, 10)
    os.remove(os.path.join(broken, "__0_0.distcp"))
    fake_checkpoint(tmp_path, 15, complete=False)
    choice = folders.choose_resume_step(str(tmp_path))
    assert choice.step == 5
    assert list(choice.skipped) == ["step-10"]
    assert folders.leftovers(str(tmp_path), folders.PARTIAL) == ["step-15.partial"]


def test_retention_keeps_latest_valid_and_leaves_corrupt_and_partial(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    corrupt = fake_checkpoint(tmp_path, 0)
    os.remove(os.path.join(corrupt, "__0_0.distcp"))
    fake_checkpoint(tmp_path, 5, complete=False)
    reclaimer = folders.Reclaimer(str(tmp_path), folders.Retention(2))
    reclaimer.start(protect={4})
    reclaimer.wait()
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-3", "step-4", "step-5.partial", folders.VERSIONS]


def test_retention_never_removes_protected_step(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    reclaimer = folders.Reclaimer(str(tmp_path), folders.Retention(1))
    reclaimer.start(protect={1})
    reclaimer.wait()
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-3", folders.VERSIONS]


def test_keep_zero_keeps_everything(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    reclaimer = folders.Reclaimer(str(tmp_path), folders.Retention(0))
    reclaimer.start(protect=set())
    reclaimer.wait()
    assert len(os.listdir(tmp_path)) == 3


def test_milestones_named_steps_and_leases_over_30_saves(tmp_path):
    """keep_latest 2 + every 5th + step 7 named, a pass after each of 30 saves; a reader holds step 3 until
    step 20 is saved."""
    root = str(tmp_path)
    reclaimer = folders.Reclaimer(root, folders.Retention(2, every=5, steps=frozenset({7})))
    with folders.hold(root, 3):
        for step in range(1, 21):
            fake_checkpoint(tmp_path, step)
            reclaimer.start(protect={step})
            reclaimer.wait()
        assert 3 in folders.named_steps(root)
    for step in range(21, 31):
        fake_checkpoint(tmp_path, step)
        reclaimer.start(protect={step})
        reclaimer.wait()
    assert folders.named_steps(root) == [5, 7, 10, 15, 20, 25, 29, 30]
    store = folders.read_store(root)
    assert store["removing"] == []
    assert {v["step"]: v["kept_as"] for v in store["versions"].values()} == {
        5: "milestone", 7: "named", 10: "milestone", 15: "milestone", 20: "milestone", 25: "milestone",
        29: "latest", 30: "latest"}
    assert store["versions"]["step-5"]["refs"] == ["step-5"]
    assert sorted(os.listdir(root)) == sorted([*(f"step-{s}" for s in (5, 7, 10, 15, 20, 25, 29, 30)), "leases",
                                               folders.VERSIONS])  # nothing half-removed is left


def test_an_interrupted_removal_is_finished_unless_the_step_is_protected(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    # A pass was killed after writing its intent (steps 1, 2 and 3) and renaming step-1 only.
    os.replace(folders.step_folder(root, 1), folders.step_folder(root, 1) + folders.RECLAIMING)
    folders._write_store(root, {"format": 1, "versions": {}, "removing": ["step-1", "step-2", "step-3"]})
    folders.Reclaimer(root, folders.Retention(1)).recover(protect={3})  # step 3 is being loaded
    assert sorted(os.listdir(root)) == ["step-3", "step-4", folders.VERSIONS]
    assert folders.read_store(root)["removing"] == []
