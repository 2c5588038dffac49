"""Pre-tokenized shards: what pretokenize writes, resuming it, reading them back as the same windows as raw
text, each rank reading only its own windows, refusing another tokenizer's shards, exhaustion policies."""

import json
import shutil

import pytest
import torch

from torchtitan.components.tokenizer.backends import SHIPPED_TOKENIZER, build_tokenizer
from torchtitan.config import ConfigManager
from torchtitan.datasets import shards as shards_mod
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.datasets.packing import GlobalBatchSlicer, ShardWindows
from torchtitan.datasets.pretokenize import main as pretokenize
from torchtitan.datasets.shards import open_shards
from torchtitan.datasets.sources import open_documents


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def shard_root(tmp_path_factory):
    """The shipped validation split (14 documents) in parts of 4 documents, written by 2 processes."""
    out = tmp_path_factory.mktemp("shards") / "stdlib"
    argv = ["--split", "validation", "--output", str(out), "--workers", "2", "--docs_per_part", "4"]
    assert pretokenize(argv) == 0
    return out


def test_shards_hold_the_tokenized_documents(shard_root, tok):
    folder = shard_root / "validation"
    manifest = json.loads((folder / "manifest.json").read_text())
    docs = list(open_documents("stdlib_docs", None, "validation").iter_from(0))
    assert manifest["num_docs"] == len(docs) == 14
    assert [p["num_docs"] for p in manifest["parts"]] == [4, 4, 4, 2]
    assert manifest["tokenizer"]["sha256"] == shards_mod.tokenizer_fingerprint(tok)["sha256"]
    assert manifest["source"] == {"dataset": "stdlib_docs", "dataset_path": None, "split": "validation"}
    expected = [t for d in docs for t in tok.encode(d, bos=True, eos=True)]
    shards = open_shards(folder, tok)
    assert shards.tokens(0, shards.num_tokens).tolist() == expected
    # The document index: each part's end offsets are its documents' lengths, accumulated.
    import numpy as np

    ends = np.fromfile(folder / "part-00001.docs", dtype=np.int64)
    assert ends.tolist() == list(np.cumsum([len(tok.encode(d, bos=True, eos=True)) for d in docs[4:8]]))


def test_pretokenize_resumes_and_refuses_other_settings(shard_root, tmp_path):
    out = tmp_path / "stdlib"
    shutil.copytree(shard_root, out)
    folder = out / "validation"
    manifest = (folder / "manifest.json").read_text()
    kept_mtime = (folder / "part-00000.tokens").stat().st_mtime_ns
    lost = (folder / "part-00002.tokens").read_bytes()
    for suffix in (".tokens", ".docs", ".json"):  # an interrupted run: part 2 never completed
        (folder / f"part-00002{suffix}").unlink()
    argv = ["--split", "validation", "--output", str(out), "--docs_per_part", "4"]
    assert pretokenize(argv) == 0
    assert (folder / "manifest.json").read_text() == manifest
    assert (folder / "part-00002.tokens").read_bytes() == lost
    assert (folder / "part-00000.tokens").stat().st_mtime_ns == kept_mtime  # not rewritten
    assert pretokenize(argv[:-1] + ["5"]) == 2  # other part size into the same folder: refused


def _loader(tok, dataset, *, dp_rank=0, dp_degree=1, gbs=4, extra=()):
    cfg = ConfigManager().parse_args(["--training.dataset", str(dataset), "--training.seq_len", "32", *extra])
    return build_text_dataloader(tokenizer=tok, job_config=cfg, split="validation", dp_rank=dp_rank,
                                 dp_degree=dp_degree, global_batch_size=gbs, local_batch_size=2, infinite=False)


def test_shards_give_the_same_samples_as_raw_text(shard_root, tok):
    from_text = list(_loader(tok, "stdlib_docs"))
    from_shards = list(_loader(tok, shard_root))
    assert len(from_text) == len(from_shards) > 100
    for (ti, tl), (si, sl) in zip(from_text, from_shards):
        assert torch.equal(ti, si) and torch.equal(tl, sl)


def test_a_rank_reads_only_the_windows_of_its_slice(shard_root, tok, monkeypatch):
    reads = []
    real = shards_mod.ShardSet.tokens
    monkeypatch.setattr(shards_mod.ShardSet, "tokens",
                        lambda self, start, n: reads.append(start) or real(self, start, n))
    it = iter(_loader(tok, shard_root, dp_rank=1, dp_degree=4, gbs=8))
    for _ in range(3):  # 3 global batches: this rank's 2 windows of each (samples 2, 3 of every 8)
        next(it)
    assert reads == [w * 33 for step in range(3) for w in (8 * step + 2, 8 * step + 3)]


def test_shards_of_another_tokenizer_are_refused(shard_root, tmp_path):
    lines = SHIPPED_TOKENIZER.read_bytes().splitlines(keepends=True)
    # Same format and size, two merges' ranks swapped: a different tokenizer under the same file name.
    a, b = lines[300].split(), lines[301].split()
    lines[300], lines[301] = b[0] + b" " + a[1] + b"\n", a[0] + b" " + b[1] + b"\n"
    other = tmp_path / SHIPPED_TOKENIZER.name
    other.write_bytes(b"".join(lines))
    with pytest.raises(ValueError) as err:
        open_shards(shard_root / "validation", build_tokenizer(other))
    msg = str(err.value)
    assert "\n" not in msg and "written with tokenizer" in msg and "--model.tokenizer_path" in msg


def test_missing_split_is_one_clear_error(shard_root, tok):
    cfg = ConfigManager().parse_args(["--training.dataset", str(shard_root)])
    with pytest.raises(FileNotFoundError, match="no train/ split"):
        build_text_dataloader(tokenizer=tok, job_config=cfg, split="train", dp_rank=0, dp_degree=1,
                              global_batch_size=4, local_batch_size=4, infinite=True)


@pytest.mark.parametrize("policy", ["stop", "loop"])
def test_exhausted_source_stops_or_loops(shard_root, tok, policy):
    source = ShardWindows(open_shards(shard_root / "validation", tok), 65, policy)
    n = source.windows_per_epoch
    ds = GlobalBatchSlicer([source], [1.0], global_batch_size=4, dp_rank=0, dp_degree=1)
    got = [x for (x, _), _ in zip(ds, range(2 * n))]
    if policy == "stop":
        assert len(got) == n // 4 * 4  # whole global batches only
    else:
        assert len(got) == 2 * n and all(torch.equal(got[i], got[i + n]) for i in range(n))


@pytest.mark.parametrize("argv,error,match", [
    (["--training.dataset", "stdlib_doc"], ValueError, "did you mean 'stdlib_docs'"),
    (["--training.dataset", "/no/such/shards"], FileNotFoundError, "shard folder /no/such/shards does not exist"),
    (["--training.datasets", "stdlib_docs:1", "--training.dataset_path", "x.jsonl"], ValueError,
     "dataset_path applies to --training.dataset only"),
])
def test_bad_dataset_settings_are_one_clear_error(tok, argv, error, match):
    cfg = ConfigManager().parse_args(argv)
    with pytest.raises(error, match=match):
        build_text_dataloader(tokenizer=tok, job_config=cfg, split="train", dp_rank=0, dp_degree=1,
                              global_batch_size=4, local_batch_size=4, infinite=True)


def _damaged_copy(shard_root, tmp_path, damage) -> tuple:
    """The shards as a train split in a fresh folder, with `damage(path)` done to part-00000's tokens (where
    the first step's windows are)."""
    folder = tmp_path / "shards"
    shutil.copytree(shard_root / "validation", folder / "train")
    part = folder / "train" / "part-00000.tokens"
    damage(part)
    return folder, part


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:-2])


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_damaged_shard_parts_are_refused_naming_the_part(shard_root, tok, tmp_path, capsys):
    """A part cut short is refused when the shards are opened (its size); one with a changed byte when it is
    first read (its CRC-32, written by pretokenize). Through the trainer both stop the run with one line naming
    the part before the first step."""
    from tests.unit.checkpoint_helpers import run

    short, short_part = _damaged_copy(shard_root, tmp_path / "a", _cut_short)
    with pytest.raises(ValueError, match=f"shard part {short_part} has .* bytes, .* were written") as err:
        open_shards(short / "train", tok)
    assert "\n" not in str(err.value) and "rerun the same pretokenize command" in str(err.value)

    flipped, flipped_part = _damaged_copy(shard_root, tmp_path / "b", _flip_a_byte)
    shards = open_shards(flipped / "train", tok)  # sizes are right
    with pytest.raises(ValueError, match=f"shard part {flipped_part} does not match its checksum"):
        shards.tokens(0, shards.num_tokens)

    for folder, part, message in ((short, short_part, "bytes"), (flipped, flipped_part, "does not match")):
        out = folder.parent / "run"
        assert run(out, "--training.dataset", str(folder), "--training.steps", "4") == 1
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"shard part {part} " in errors[0] and message in errors[0], errors
        assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()


def test_training_from_shards_in_a_bucket_equals_disk_across_a_resume(shard_root, tmp_path, store):
    """The same shards on disk and in the store (uploaded as they are): a straight 4-step run from the disk
    copy and a 2 + 2 run (checkpoint, resume) from the store's copy log the same losses, bit for bit, so the
    store's windows are the disk's and the data position survives the resume. (The local variant is the
    resume from disk against the straight run.)"""
    from tests.unit.checkpoint_helpers import losses, run

    disk = tmp_path / "stdlib"
    shutil.copytree(shard_root / "validation", disk / "train")  # the split the trainer reads
    source = str(disk)
    if store.kind == "s3":
        from torchtitan.tools import storage

        source = f"s3://{store.bucket}/shards/stdlib"
        fs, path = storage.filesystem(source)
        fs.put(str(disk) + "/", path + "/", recursive=True)
    argv = ["--training.datasets", f"{source}:1", "--checkpoint.enable",
            "--checkpoint.interval", "2", *store.argv]
    assert run(tmp_path / "straight", "--training.datasets", f"{disk}:1", "--training.steps", "4") == 0
    assert run(tmp_path / "resumed", *argv, "--training.steps", "2") == 0
    assert run(tmp_path / "resumed", *argv, "--training.steps", "4") == 0
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
