"""--checkpoint.hf_interval: Hub-ready Hugging Face folders written during the run (one process, debugmodel_tiny).

4 steps with hf_interval 2 (and interval 2, so the DCP step-2 checkpoint is there to compare with): hf-step-2
and hf-step-4 are complete folders (save_pretrained's files plus the tokenizer), transformers loads hf-step-2
and computes the logits of our model at step 2 (fp32 export, within 1e-5 of the logits' scale: the two
implementations sum in different orders), AutoTokenizer gives the project's ids, and a resume still
chooses the DCP step-N checkpoints; on a local folder and on the S3 server. Bad values are refused by the pre-flight check in one line.
"""


import pytest
import torch

from tests.unit.checkpoint_helpers import run
from tests.tolerances import contraction_width, logits_tol
from torchtitan import preflight
from torchtitan.tools import storage
from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.manager import RUN_RECORD
from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of, load_model_weights

transformers = pytest.importorskip("transformers")

HUB_FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
             "tokenizer.json", "tokenizer_config.json"]
TOKENS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))


def _ours_at(step_folder: str) -> tuple[torch.Tensor, dict]:
    """Our logits, and the tolerance of another float32 forward pass of the same model on them."""
    model, spec, _, args = build_cpu_model(job_config_of(step_folder, []))
    load_model_weights(model, step_folder, spec.state_dict_adapter, args)
    with torch.no_grad():
        out = model.eval()(TOKENS)
    logits = getattr(out, "logits", out)
    return logits, logits_tol(logits, len(model.layers), contraction_width(model, TOKENS.shape[1]))


def _hf(folder: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def test_hf_interval_writes_hub_ready_folders_that_transformers_loads(tmp_path, store):
    """On a local folder and on the S3 server: from the bucket, the folders are copied out (as a user would,
    e.g. `aws s3 cp --recursive`) and loaded from there."""
    common = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.hf_interval", "2",
              "--checkpoint.export_dtype", "float32", *store.argv]
    assert run(tmp_path, "--training.steps", "4", *common) == 0
    root = store.root(tmp_path)
    extra = [folders.LATEST, RUN_RECORD] if store.kind == "s3" else []
    assert storage.listdir(root) == sorted(["hf-step-2", "hf-step-4", "step-2", "step-4", *extra])  # no .partial
    for step in (2, 4):
        assert storage.listdir(storage.join(root, f"hf-step-{step}")) == HUB_FILES
    local = tmp_path / "copied"
    for name in ("hf-step-2", "hf-step-4", "step-2"):  # a no-op copy for the local folder
        storage.copy_out(storage.join(root, name), str(local / name))
    expected, tol = _ours_at(str(local / "step-2"))
    got = _hf(str(local / "hf-step-2"))
    torch.testing.assert_close(got, expected, **tol)  # Measured: uses 0.0024 of it (AVX-512), 0.002 (AVX2 caps).
    assert not torch.allclose(_hf(str(local / "hf-step-4")), got), "hf-step-4 holds the same weights as hf-step-2"

    from torchtitan.components.tokenizer.backends import build_tokenizer

    sample = "def walk(top):\n    \"\"\"Directory tree generator.\"\"\"  12 été"
    hf_tok = transformers.AutoTokenizer.from_pretrained(local / "hf-step-2")
    assert hf_tok(sample).input_ids == build_tokenizer(None).encode(sample, bos=True, eos=False)

    # The hf-step-N folders sit beside the step-N checkpoints without being taken for one: a resume chooses step-4.
    choice = folders.choose_resume_step(root)
    assert (choice.step, choice.skipped) == (4, {})


@pytest.mark.parametrize("args, message", [
    (["--checkpoint.enable", "--checkpoint.hf_interval", "-2"],
     "--checkpoint.hf_interval must be 0 (only as last_save says) or more, got -2"),
    (["--checkpoint.hf_interval", "2"], "--checkpoint.hf_interval 2 writes hf-step-N folders from the checkpointer: "
                                        "add --checkpoint.enable"),
    (["--checkpoint.enable", "--checkpoint.hf_max_shard_mb", "0"], "--checkpoint.hf_max_shard_mb must be at least 1"),
    # a LoRA run's model is base + adapters, which no HF architecture holds (was a KeyError at the first save)
    (["--checkpoint.enable", "--checkpoint.hf_interval", "2", "--model.converters", "lora"],
     "--checkpoint.hf_interval 2 writes the model as trained, and --model.converters lora trains adapters"),
    (["--checkpoint.enable", "--checkpoint.last_save", "hf_only", "--model.converters", "lora"],
     "keep --checkpoint.last_save full and write the folder from a step checkpoint with scripts/checkpoints/convert_to_hf.py"),
])
def test_bad_hf_saves_are_refused_before_ranks_start(args, message, tmp_path, capsys):
    argv = ["--world-size", "1", "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path / "run")]
    assert preflight.main(argv + args) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()
