"""Published checkpoints pad their vocabulary past the tokenizer's (DeepSeek-V3: 128,815 tokens in 129,280 rows). For
every family (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3, GPT-OSS, Qwen3.5), a random transformers model whose vocabulary
is the shipped tokenizer's 2,048 + 37 (an amount no power of two divides, so FSDP's row shards are uneven too) is
saved with save_pretrained; the trainer takes its shape (--model.hf_config) and weights
(--checkpoint.initial_load_in_hf) from the folder under FSDP 2, trains 2 steps at LR 0 and writes an HF folder
(--checkpoint.last_save hf_only, float32).
Checked per family:
- the model keeps the folder's 2,085 rows (the vocabulary rule, protocols/model.py `job_vocab_size`);
- HF -> ours: the sharded model's logits right after loading equal transformers' on the folder, within 1e-5
  of the logits' scale (the two implementations sum in different orders);
- the round trip: every tensor written equals the folder's bit for bit, padded rows included, and
  config.json keeps vocab_size 2,085.
All families run in one 2-rank group, one after the other (one start of the ranks for the module). MoE families
run with --moe.load_balance_coeff 0: the router-bias update is not an optimizer step, LR 0 would not stop it.
"""

import json
import os

import pytest
import torch

from tests.distributed.test_hf_any_size import CASES, _hf_logits, _logits, hf_config_tol
from tests.multiprocess import run_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

VOCAB = 2048 + 37
FAMILIES = {  # family -> (a case of test_hf_any_size whose shape to reuse, changes to its config)
    "llama3": ("llama_tied_hd64", {"tie_word_embeddings": False}),  # untied: embedding and lm_head both padded
    "qwen3": ("qwen3_hd24", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_q_lora", {}),
    "gpt_oss": ("gpt_oss", {}),  # sliding and full attention layers, sinks, YaRN
    "qwen3_5": (None, {}),  # Gated DeltaNet and gated attention layers: tests/unit/test_qwen3_5_hf.py's dense shape
}
OPTIONS = [
    "--training.seq_len", "32", "--training.global_batch_size", "4", "--training.local_batch_size", "2",
    "--training.steps", "2", "--training.mixed_precision_param", "float32", "--optimizer.lr", "0",
    "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--debug.seed", "3",
    "--parallelism.data_parallel_shard_degree", "2",
    "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.last_save", "hf_only",
    "--checkpoint.export_dtype", "float32",
]


def _qwen3_5_config(args=None, vocab: int = VOCAB):
    """transformers' config of a Qwen3.5 shape (default: tests/unit/test_qwen3_5_hf.py's dense one)."""
    import dataclasses

    from tests.unit.test_qwen3_5_hf import DENSE
    from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter

    args = DENSE if args is None else args
    hf = Qwen3_5StateDictAdapter.to_hf_config(dataclasses.replace(args, vocab_size=vocab), torch.float32)
    cls = transformers.Qwen3_5MoeTextConfig if args.moe else transformers.Qwen3_5TextConfig
    return cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")})


def _make_folder(family: str, folder: str) -> None:
    case, changes = FAMILIES[family]
    if case is None:
        config = _qwen3_5_config()
    else:
        _, cls, kwargs, _ = CASES[case]
        config = getattr(transformers, cls)(vocab_size=VOCAB, **{**kwargs, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # far from the default init, so attention is sharp and norms count
        for key, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if key.endswith("norm.weight") else p.normal_(0, 0.2)
    model.save_pretrained(folder)


def _run(rank, world_size, runs, options=OPTIONS):
    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    results = {}
    for family, folder, dump, extra in runs:
        cfg = config_manager().parse_args(options + extra + [
            "--model.name", family, "--model.hf_config", folder, "--checkpoint.initial_load_path", folder,
            "--job.dump_folder", dump,
        ])
        trainer = Trainer(cfg)
        try:
            trainer.checkpointer.load()
            trainer.checkpointer.load = lambda: True  # train() would read the folder again
            before = _logits(trainer)
            trainer.train()
            results[family] = (trainer.model_args.vocab_size, before)
        finally:  # Trainer.close() would also end the process group, which the next family still uses
            trainer.checkpointer.close()
            trainer.metrics.close()
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded_vocab")
    runs = []
    for family in FAMILIES:
        _make_folder(family, str(root / family / "hf_in"))
        moe = ["--moe.load_balance_coeff", "0"] if family in ("qwen3_moe", "deepseek_v3", "gpt_oss") else []
        runs.append((family, str(root / family / "hf_in"), str(root / family / "run"), moe))
    return root, run_ranks(_run, 2, runs)[0]


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_padded_vocabulary_loads_trains_and_comes_back_bit_exact(trained, family):
    root, results = trained
    vocab, before = results[family]
    assert vocab == VOCAB, f"{family}: the model has {vocab} rows, the folder {VOCAB}"
    hf_in, hf_out = root / family / "hf_in", root / family / "run" / "checkpoint" / "hf-step-2"
    expected = _hf_logits(str(hf_in))
    assert before.shape[-1] == VOCAB
    # qwen3_5: the unit test's dense shape, 5 layers, FFN 80. Measured: uses 0.14 of it (AVX-512), 0.096 (AVX2 caps).
    case = FAMILIES[family][0]
    config = CASES[case][2] if case else {"num_hidden_layers": 5, "intermediate_size": 80, "hidden_size": 48}
    torch.testing.assert_close(before, expected, **hf_config_tol(config, expected), msg=f"{family}: HF -> ours")
    written, original = _tensors(str(hf_out)), _tensors(str(hf_in))
    assert sorted(written) == sorted(original)
    assert original["model.embed_tokens.weight"].shape[0] == VOCAB
    for key, value in original.items():
        assert torch.equal(written[key], value), f"{family}: {key} changed at LR 0"
    with open(hf_out / "config.json") as f:
        assert json.load(f)["vocab_size"] == VOCAB
