"""The rest of a run's state on an object store (moto's S3 server, tests/conftest.py `s3_server`), beside the
checkpoints that test_checkpoint_*.py and test_object_storage.py cover:

* a Hugging Face folder in the bucket as --checkpoint.initial_load_path (and --model.hf_config and
  --model.tokenizer_path): the same
  losses as from the folder on disk, bit for bit; each box of a tensor is read with ranged GETs that fetch
  only its bytes (the per-rank cost stays a shard);
* a seed checkpoint written to the bucket (create_seed_checkpoint --output URL) starts the same run as one on disk;
* a LoRA run's step checkpoint in the bucket exported to the bucket in peft's format, which peft loads after
  copying it out;
* TensorBoard event files copied beside the checkpoints (`run/tb/`), as metrics.jsonl is.
"""

import os
import random
import sys
import uuid

import pytest
import torch
from safetensors import safe_open

from tests.unit.checkpoint_helpers import losses, run
from torchtitan.components.checkpoint import folders, hf_folder
from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of
from torchtitan.protocols.train_spec import config_manager
from torchtitan.tools import storage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "checkpoints"))
import convert_to_hf  # noqa: E402


@pytest.fixture
def bucket(s3_server):
    from tests.s3_server import make_bucket

    name = f"state-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_server.endpoint, name)
    storage.reset_clients()
    return f"s3://{name}"


@pytest.fixture(scope="module")
def hf_local(tmp_path_factory):
    """A Hugging Face folder of the tiny Llama under another seed than the runs' (so that loading it shows in
    the losses), split into several safetensors files with an index."""
    cfg = config_manager().parse_args(["--model.flavor", "debugmodel_tiny", "--debug.seed", "7"])
    model, spec, tokenizer, args = build_cpu_model(cfg)
    out = str(tmp_path_factory.mktemp("hf") / "hf")
    hf_folder.save_hf_folder(model.state_dict(), spec.state_dict_adapter, args, out, dtype=torch.float32,
                             max_shard_bytes=200_000, tokenizer=tokenizer)
    assert os.path.isfile(os.path.join(out, hf_folder.INDEX))
    return out


def test_hf_folder_in_the_bucket_starts_the_run_as_from_disk(hf_local, bucket, tmp_path):
    url = f"{bucket}/models/tiny"
    hf_folder.upload_files(hf_local, url)
    assert run(tmp_path / "disk", "--training.steps", "2", "--checkpoint.initial_load_path", hf_local,
               "--checkpoint.initial_load_in_hf", "--model.tokenizer_path", hf_local) == 0
    # The model's shape (config.json) and the tokenizer (tokenizer.json + tokenizer_config.json) from the bucket too.
    assert run(tmp_path / "store", "--training.steps", "2", "--checkpoint.initial_load_path", url,
               "--checkpoint.initial_load_in_hf", "--model.hf_config", url, "--model.tokenizer_path", url) == 0
    assert run(tmp_path / "none", "--training.steps", "2", "--model.tokenizer_path", hf_local) == 0
    assert losses(tmp_path / "store") == losses(tmp_path / "disk")
    assert losses(tmp_path / "none") != losses(tmp_path / "disk")  # the control: the folder's weights mattered


def test_a_box_is_read_with_ranged_gets_of_its_own_bytes(hf_local, bucket, monkeypatch):
    """Random boxes of tensors (of each rank 1 and 2 shape, from each file) read from the bucket equal
    safetensors' slicing of the local file; with no gap merging, the bytes fetched are exactly the box's (a rank
    of a sharded model fetches its shard)."""
    url = f"{bucket}/models/tiny"
    hf_folder.upload_files(hf_local, url)
    fetched = []
    read_ranges = storage.read_ranges

    def counting(path, ranges):
        fetched.extend(b - a for a, b in ranges)
        return read_ranges(path, ranges)

    monkeypatch.setattr(storage, "read_ranges", counting)
    reader = hf_folder.SliceReader(url)
    rng = random.Random(0)
    for merge_gap in (0, hf_folder.MERGE_GAP_BYTES):
        monkeypatch.setattr(hf_folder, "MERGE_GAP_BYTES", merge_gap)
        keys = sorted(reader.where)
        picked = {(reader.where[k], len(reader.shape(k))): k for k in rng.sample(keys, len(keys))}
        for key in sorted(picked.values()):
            shape = reader.shape(key)
            for _ in range(3):
                offsets = [rng.randrange(n) for n in shape]
                sizes = [rng.randint(1, n - o) for n, o in zip(shape, offsets)]
                if merge_gap == 0 and len(shape) > 1:
                    sizes[0] = min(sizes[0], 8)  # one GET per row without merging: a few rows keep it quick
                fetched.clear()
                got = reader.read(key, offsets, sizes)
                with safe_open(os.path.join(hf_local, reader.where[key]), framework="pt") as f:
                    want = f.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert got.dtype == want.dtype and torch.equal(got, want), (key, offsets, sizes)
                if merge_gap == 0:
                    assert sum(fetched) == want.numel() * want.element_size(), (key, offsets, sizes)


def test_seed_checkpoint_in_the_bucket_starts_the_same_run(bucket, tmp_path):
    from torchtitan.create_seed_checkpoint import main as seed_main

    seed = f"{bucket}/seed"
    assert seed_main(["--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path / "s"),
                      "--output", seed]) == 0
    assert folders.problem(seed) is None
    assert run(tmp_path / "plain", "--training.steps", "2") == 0
    assert run(tmp_path / "seeded", "--training.steps", "2", "--checkpoint.initial_load_path", seed) == 0
    assert losses(tmp_path / "seeded") == losses(tmp_path / "plain")


def test_lora_adapters_exported_to_the_bucket_load_in_peft(bucket, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.unit.test_lora import TINY_RUN, _logits_close
    from torchtitan.components.checkpoint.hf_folder import save_hf_folder
    from torchtitan.components.lora.export import load_lora_model
    from torchtitan.models.common.qwen3_state_dict_adapter import Qwen3StateDictAdapter
    from torchtitan.train import main

    root = f"{bucket}/lora/checkpoint"
    assert main(TINY_RUN + ["--training.steps", "2", "--job.dump_folder", str(tmp_path / "run"),
                            "--checkpoint.folder", root]) == 0
    step = f"{root}/step-2"
    out = f"{bucket}/lora/peft"
    assert convert_to_hf.main([step, out, "--peft", str(tmp_path / "base")]) == 0
    assert storage.listdir(out) == ["adapter_config.json", "adapter_model.safetensors"]
    storage.copy_out(out, str(tmp_path / "peft"))

    model, _, args = load_lora_model(step, job_config_of(step, []))
    base, _, _, _ = build_cpu_model(job_config_of(step, []))
    save_hf_folder(base.state_dict(), Qwen3StateDictAdapter, args, str(tmp_path / "base"), dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with_adapters = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    with torch.no_grad():
        adapted, base_logits = model(tokens), base(tokens)
        assert (adapted - base_logits).abs().max() > 100 * 1e-5 * adapted.abs().max()  # the check can fail
        _logits_close(with_adapters(tokens).logits, adapted, model)


def test_tensorboard_events_are_copied_beside_the_checkpoints(bucket, tmp_path):
    pytest.importorskip("tensorboard")
    root = f"{bucket}/tb/checkpoint"
    assert run(tmp_path, "--training.steps", "2", "--metrics.enable_tensorboard", "--checkpoint.enable",
               "--checkpoint.interval", "2", "--checkpoint.folder", root) == 0
    local = storage.file_sizes(str(tmp_path / "tb"))
    assert local and all(name.startswith("events.out.tfevents") for name in local)
    copied = storage.file_sizes(f"{root}/run/tb")
    assert copied == local
