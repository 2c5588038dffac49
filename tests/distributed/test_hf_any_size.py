"""Any Hugging Face checkpoint in, a Hub-ready one out, under FSDP 2 x TP 2 (4 gloo ranks), for every family.

For each family, on a shape no flavor has (Llama with tied embeddings and head_dim 64; Qwen3 with head_dim
!= dim/heads; Qwen3-MoE; DeepSeek-V3 with and without q_lora_rank; GPT-OSS with a window of 5, sinks and
biases, sharded by TP and EP): a random transformers model is saved with
save_pretrained; the trainer (MoE families: also EP 2) takes its shape from the folder (--model.hf_config) and its weights from it
(--checkpoint.initial_load_in_hf, each rank reading only its slices), trains 2 steps, and writes an HF folder
from the shards (--checkpoint.last_save hf_only). Checked, in float32:
- HF -> ours: the sharded model's logits right after loading equal transformers' on the input folder;
- ours -> HF: transformers' AutoModelForCausalLM on the written folder gives the trained model's logits;
both within 1e-5 of the logits' scale (the two implementations sum in different orders). AutoTokenizer on
the written folder gives the project tokenizer's ids on sample text. The Llama folder is written with a 1 MB
size limit: 3+ safetensors files named and indexed as save_pretrained does.
All cases run in one spawned 4-rank group, one after the other, to keep the suite short. The Qwen3-MoE and
GPT-OSS runs use the default balancing of a model from such a folder (no bias updates, transformers'
load-balancing loss with the folder's coefficient: docs/moe.md), so that default is exported under TP x EP too.

With s3fs and moto installed, the Llama folder is also uploaded to a bucket of the S3 server
(tests/conftest.py `s3_server`) and a run loads it from there (--model.hf_config and initial_load_path the URL;
each rank fetching its own boxes with ranged GETs, TP's row-wise weights split along dim 1): its logits after
loading and after training equal, bit for bit, the run from disk (same layout, same bytes: nothing may differ).
"""

import importlib.util
import json
import os
import uuid

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.tolerances import logits_tol

pytestmark = pytest.mark.distributed  # a 4-rank group

transformers = pytest.importorskip("transformers")

VOCAB = 2048  # the shipped tokenizer's
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def hf_config_tol(config: dict, expected: torch.Tensor) -> dict:
    """Two float32 forward passes (transformers' and ours, under FSDP x TP or in one process) of a model of
    this HF config: logits_tol of its depth and longest contraction."""
    width = max([TOKENS.shape[1]] + [config.get(k, 0) for k in ("hidden_size", "intermediate_size",
                                                                  "moe_intermediate_size")])
    return logits_tol(expected, config["num_hidden_layers"], width)


COMMON = [
    "--training.seq_len", "32", "--training.global_batch_size", "4", "--training.local_batch_size", "2",
    "--training.steps", "2", "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2",
    "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--debug.seed", "3",
    "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
    "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.last_save", "hf_only",
    "--checkpoint.export_dtype", "float32"
]
ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
EP = ["--parallelism.expert_parallel_degree", "2"]  # MoE under TP splits the experts over the tp ranks' tokens
CASES = {
    # (model name, transformers config class, config, extra options)
    "llama_tied_hd64": ("llama3", "LlamaConfig", dict(
        hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=64,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        ["--checkpoint.hf_max_shard_mb", "1"]),
    "qwen3_hd24": ("qwen3", "Qwen3Config", dict(
        hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, tie_word_embeddings=False, max_position_embeddings=64, rope_parameters=ROPE), []),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", dict(
        hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        max_position_embeddings=64, rope_parameters=ROPE),
        EP),  # default balancing: the format's loss (its router has no bias to export a moved one into)
    "deepseek_q_lora": ("deepseek_v3", "DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.0, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64, rope_parameters=ROPE), EP),
}
CASES["gpt_oss"] = ("gpt_oss", "GptOssConfig", dict(  # both layer kinds, a window shorter than seq_len, YaRN
    hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.6,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 16}),
    EP)  # default balancing: HF's GPT-OSS router has no balancing bias, so the format's loss
CASES["deepseek_direct_q"] = (*CASES["deepseek_q_lora"][:2], {**CASES["deepseek_q_lora"][2], "q_lora_rank": None}, EP)


def _hf_logits(folder: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def _make_hf_folder(name: str, folder: str) -> None:
    _, cls, kwargs, _ = CASES[name]
    config = getattr(transformers, cls)(vocab_size=VOCAB, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # far from the default init, so attention is sharp and norms count
        for key, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if key.endswith("norm.weight") else p.normal_(0, 0.2)
    model.save_pretrained(folder)


def _logits(trainer) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    model = trainer.model_parts[0]
    with torch.no_grad():
        out = model(TOKENS)
    out = getattr(out, "logits", out)
    return (out.full_tensor() if isinstance(out, DTensor) else out).detach().clone()


def _run_cases(rank, world_size, cases):
    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    results = {}
    for name, model_name, folder, dump, extra in cases:
        cfg = config_manager().parse_args(COMMON + extra + [
            "--model.name", model_name, "--model.hf_config", folder, "--checkpoint.initial_load_path", folder,
            "--job.dump_folder", dump,
        ])
        trainer = Trainer(cfg)
        try:
            trainer.checkpointer.load()
            trainer.checkpointer.load = lambda: True  # train() would read the folder again
            before = _logits(trainer)
            trainer.train()
            results[name] = (before, _logits(trainer))
        finally:  # Trainer.close() would also end the process group, which the next case still uses
            trainer.checkpointer.close()
            trainer.metrics.close()
    return results


def _check_index_layout(folder: str) -> None:
    """save_pretrained's sharded layout: model-0000i-of-0000n.safetensors and an index of every tensor."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert len(files) >= 3, files
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(index) == ["metadata", "weight_map"] and set(index["weight_map"].values()) == set(files)
    total = 0
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == name for k in keys)
            total += sum(f.get_tensor(k).numel() * 4 for k in keys)  # float32
    assert index["metadata"]["total_size"] == total
    assert not os.path.exists(os.path.join(folder, "sharded"))


def _in_a_bucket(request, folder: str) -> str | None:
    """`folder` uploaded to a fresh bucket of the session's S3 server; None without s3fs and moto."""
    if not all(importlib.util.find_spec(m) for m in ("s3fs", "moto")):
        return None
    from tests.s3_server import make_bucket
    from torchtitan.components.checkpoint.hf_folder import upload_files
    from torchtitan.tools import storage

    server = request.getfixturevalue("s3_server")
    bucket = f"hf-{uuid.uuid4().hex[:12]}"
    make_bucket(server.endpoint, bucket)
    storage.reset_clients()
    upload_files(folder, f"s3://{bucket}/hf_in")
    return f"s3://{bucket}/hf_in"


def test_every_family_in_and_out_under_fsdp_tp(tmp_path, request):
    from torchtitan.components.tokenizer.backends import build_tokenizer

    cases, expected_in = [], {}
    for name, (model_name, _, _, extra) in CASES.items():
        folder = str(tmp_path / name / "hf_in")
        _make_hf_folder(name, folder)
        expected_in[name] = _hf_logits(folder)
        cases.append((name, model_name, folder, str(tmp_path / name / "run"), extra))
    llama = cases[0]
    transformers.AutoModelForCausalLM.from_pretrained(llama[2]).save_pretrained(llama[2], max_shard_size="100KB")
    url = _in_a_bucket(request, llama[2])
    if url is not None:
        cases.append(("llama_in_a_bucket", llama[1], url, str(tmp_path / "llama_in_a_bucket" / "run"), llama[4]))
    results = run_ranks(_run_cases, 4, cases)[0]
    if url is not None:
        store, disk = results.pop("llama_in_a_bucket"), results[llama[0]]
        assert torch.equal(store[0], disk[0]) and torch.equal(store[1], disk[1]), "HF folder in a bucket vs on disk"
    tokenizer = build_tokenizer(None)
    sample = "def walk(top):\n    \"\"\"Directory tree generator.\"\"\"  12 été"
    for name, (before, after) in results.items():
        config = CASES[name][2]  # Measured: uses 0.12 of it (AVX-512), 0.16 (AVX2 caps).
        torch.testing.assert_close(before, expected_in[name], **hf_config_tol(config, expected_in[name]),
                                   msg=f"{name}: HF -> ours")
        out = str(tmp_path / name / "run" / "checkpoint" / "hf-step-2")
        assert not torch.allclose(after, before), f"{name}: training changed nothing"
        torch.testing.assert_close(_hf_logits(out), after, **hf_config_tol(config, after), msg=f"{name}: ours -> HF")
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
        assert hf_tok(sample).input_ids == tokenizer.encode(sample, bos=True, eos=False), name
        with open(os.path.join(out, "generation_config.json")) as f:
            assert json.load(f)["eos_token_id"] == tokenizer.eos_id
        if name.startswith("llama"):
            _check_index_layout(out)
