"""LoRA in one process: bad options refused in one line before any rank starts; checkpoints that hold the
adapters, their optimizer state and the training state and refer to the frozen base (on the Qwen3 debug model
a few percent of a full checkpoint's bytes), resumed bit for bit and refused against another base; and the run
handed back to Hugging Face both ways: the merged folder and the peft adapter folder give the adapted model's
logits (fp32, within 1e-5 of the logits' scale: transformers sums in another order) in transformers."""

import json
import os
import shutil
import sys

import pytest
import torch

from tests.tolerances import contraction_width, logits_tol
from torchtitan import preflight
from torchtitan.components.lora.export import load_lora_model
from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of
from torchtitan.components.checkpoint.hf_folder import save_hf_folder
from torchtitan.models.common.qwen3_state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.train import main

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "scripts", sub) for sub in ("checkpoints", "data")]
import convert_to_hf  # noqa: E402

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.seq_len", "32",
         "--training.local_batch_size", "1", "--training.mixed_precision_param", "float32", "--debug.seed", "3",
         "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2"]
LORA_OPTIONS = ["--model.converters", "lora", "--lora.rank", "8"]
# Resume and export on the tiny flavor; a large step so the adapters move far from zero and the export
# checks below compare a real update.
TINY_RUN = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32", "--debug.seed", "3",
            "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2", "--model.converters", "lora", "--lora.rank", "8", "--lora.target_modules", "layers.*",
            "--optimizer.lr", "2e-2", "--lr_scheduler.warmup_steps", "1"]
TINY = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.steps", "1", "--model.converters", "lora"]

REJECTED = {
    "rank 0": (["--lora.rank", "0"], "--lora.rank must be at least 1 (got 0)"),
    "rank above a layer's size": (["--lora.rank", "65"], "--lora.rank 65 is above the size of layers.0.attention.wq"),
    "pattern matching nothing": (["--lora.target_modules", "layers.*.attn.wq"], "pattern 'layers.*.attn.wq' matches no module"),
    "no linear layer matched": (["--lora.target_modules", "layers.*.attention_norm"], "but no linear layer"),
    "lora before float8": (["--model.converters", "lora,float8", "--float8.emulate"], "use --model.converters float8,lora"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_bad_lora_options_are_refused_in_one_line(case, capsys):
    argv, says = REJECTED[case]
    assert preflight.main(["--world-size", "1"] + TINY + argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


def _run(folder, argv, steps):
    assert main(argv + ["--training.steps", str(steps), "--job.dump_folder", str(folder)]) == 0


def _losses(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {m["step"]: (m["loss"], m["grad_norm"]) for m in map(json.loads, f) if "loss" in m}


def _bytes(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _copy_step(run, step, folder):
    os.makedirs(folder / "checkpoint")
    shutil.copytree(run / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")


def test_lora_checkpoint_of_the_qwen3_debug_model_is_small_and_names_its_base(tmp_path):
    _run(tmp_path / "full", QWEN3, 1)
    _run(tmp_path / "lora", QWEN3 + LORA_OPTIONS, 1)
    full = _bytes(tmp_path / "full" / "checkpoint" / "step-1")
    lora = _bytes(tmp_path / "lora" / "checkpoint" / "step-1")
    print(f"Qwen3 debugmodel checkpoint bytes: full {full:,}, LoRA rank 8 on the attention projections {lora:,} "
          f"({100 * lora / full:.2f}%)")
    assert lora <= 0.05 * full
    with open(tmp_path / "lora" / "checkpoint" / "step-1" / "manifest.json") as f:
        base = json.load(f)["base"]
    assert "seed 3" in base["path"] and len(base["fingerprint"]) == 64


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    _run(folder, TINY_RUN, 4)
    return folder


def test_lora_run_resumes_bitwise(lora_run, tmp_path):
    _copy_step(lora_run, 2, tmp_path)
    _run(tmp_path, TINY_RUN, 4)
    straight, resumed = _losses(lora_run), _losses(tmp_path)
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]


def test_resume_against_another_base_is_refused_in_one_line(lora_run, tmp_path, capsys):
    _copy_step(lora_run, 2, tmp_path)
    # Another seed initialises another base model.
    assert main(TINY_RUN + ["--training.steps", "4", "--debug.seed", "4", "--job.dump_folder", str(tmp_path)]) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(err) == 1 and "was trained on base" in err[0] and "has fingerprint" in err[0], err


def _logits_close(got, want, model, condition=1.0):
    # Adapted model (x W + s (x A) B) against the merged one (x (W + s B A), one more rounding per weight) or
    # PEFT's: two float32 forward passes of the model's blocks. Measured: uses 0.068 of it (AVX-512), 0.068 (AVX2 caps).
    n_layers = len(model.layers) if hasattr(model, "layers") else model.config.num_hidden_layers
    tol = logits_tol(want, n_layers, contraction_width(model, want.shape[1]), condition)
    torch.testing.assert_close(got, want, **tol)


def test_merged_and_peft_exports_give_the_adapted_logits(lora_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    step = str(lora_run / "checkpoint" / "step-4")
    cfg = job_config_of(step, [])
    model, _, args = load_lora_model(step, cfg)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    base, _, _, _ = build_cpu_model(cfg)
    with torch.no_grad():
        adapted, base_logits = model(tokens), base(tokens)
    # The adapters changed the model well beyond the tolerance, so the checks below can fail.
    assert (adapted - base_logits).abs().max() > 100 * 1e-5 * adapted.abs().max()

    assert convert_to_hf.main([step, str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert convert_to_hf.main([step, str(tmp_path / "peft"), "--peft", str(tmp_path / "base")]) == 0
    save_hf_folder(base.state_dict(), Qwen3StateDictAdapter, args, str(tmp_path / "base"), dtype=torch.float32)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with_adapters = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    with torch.no_grad():
        _logits_close(merged(tokens).logits, adapted, model)
        _logits_close(with_adapters(tokens).logits, adapted, model)


def test_shipped_sft_set_is_rebuilt_by_its_script_and_holds_out_unseen_answers(tmp_path):
    import build_sft_data
    from torchtitan.datasets.sources import open_documents

    shipped = build_sft_data.OUT
    build_sft_data.build(build_sft_data.CORPUS, tmp_path / "qa.jsonl.gz")
    assert (tmp_path / "qa.jsonl.gz").read_bytes() == shipped.read_bytes()
    assert shipped.stat().st_size < 1_000_000
    train = list(open_documents("chat", str(shipped), "train").iter_from(0))
    held_out = list(open_documents("chat", str(shipped), "validation").iter_from(0))
    assert len(held_out) == 30 and len(train) == 2970
    trained_answers = {r["completion"] for r in train}
    assert not any(r["completion"] in trained_answers for r in held_out)


def test_peft_export_follows_llamas_rotary_row_order(tmp_path):
    """Llama's HF layout permutes q/k rows (rotate-half vs interleaved RoPE): B's rows must follow."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torchtitan.components.lora.adapters import add_adapter, lora_modules
    from torchtitan.components.lora.export import save_merged, save_peft
    from torchtitan.models.llama3.args import TransformerModelArgs
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden_dim=160,
                                max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(buffer_device=None)
    save_hf_folder(model.state_dict(), Llama3StateDictAdapter, args, str(tmp_path / "base"), dtype=torch.float32)
    for name, m in [(n, m) for n, m in model.named_modules() if n.startswith("layers.") and isinstance(m, torch.nn.Linear)]:
        add_adapter(m, name, rank=4, alpha=8.0, dropout=0.0)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_a.normal_(0, 0.3), m.lora_b.normal_(0, 0.3)
        tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        adapted = model.eval()(tokens)
        save_peft(model, Llama3StateDictAdapter, args, str(tmp_path / "peft"), str(tmp_path / "base"))
        save_merged(model, Llama3StateDictAdapter, args, str(tmp_path / "merged"))
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
        # adapters of std 0.3 make every projection ~20x its init, attention sharp: condition 4 (as the HF tests'
        # random weights). Measured: uses 0.068 of it (AVX-512), 0.068 (AVX2 caps).
        _logits_close(peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(tokens).logits, adapted, model, 4)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        _logits_close(merged(tokens).logits, adapted, model, 4)
