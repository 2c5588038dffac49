import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from tests.tolerances import contraction_width, logits_tol
from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder
from torchtitan.models.llama3.args import RopeScalingArgs, TransformerModelArgs
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import (
    Llama3StateDictAdapter,
    from_hf_config,
    to_hf_config,
)

ARGS = TransformerModelArgs(
    dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=50, multiple_of=32, ffn_dim_multiplier=1.3,
    norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=RopeScalingArgs(factor=4, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=32),
    max_seq_len=64,
)


def random_model(args: TransformerModelArgs = ARGS) -> Transformer:
    """Weights far from the default init so attention is sharp and a wrong q/k permutation shows."""
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.5 if "attention.w" in name else 0.15)
    return model


def hf_inv_freq(config: dict) -> torch.Tensor:
    """HF's `llama3` rope: inverse frequencies, then masks for the low / medium frequency bands."""
    hd = config["hidden_size"] // config["num_attention_heads"]
    # transformers 5.x: rope_parameters; 4.x: top-level rope_theta and rope_scaling.
    s = config.get("rope_parameters") or {"rope_theta": config["rope_theta"], **(config.get("rope_scaling") or {})}
    inv = 1.0 / s["rope_theta"] ** (torch.arange(0, hd, 2).double() / hd)
    wavelen = 2 * math.pi / inv
    old = s["original_max_position_embeddings"]
    low = wavelen > old / s["low_freq_factor"]
    high = wavelen < old / s["high_freq_factor"]
    medium = ~low & ~high
    smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    out = inv.clone()
    out[low] = inv[low] / s["factor"]
    out[medium] = ((1 - smooth) / s["factor"] + smooth)[medium] * inv[medium]
    return out


def hf_llama_forward(sd: dict, config: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Naive Llama in Hugging Face conventions: HF names, rotate_half RoPE, explicit masked softmax."""
    B, S = tokens.shape
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // nh
    eps = config["rms_norm_eps"]
    angles = torch.arange(S).double()[:, None] * hf_inv_freq(config)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    causal = torch.full((S, S), float("-inf")).triu(1)
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(B, S, nh, hd).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(B, S, nkv, hd).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(B, S, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        kv_of_head = torch.arange(nh) // (nh // nkv)
        k, v = k[:, kv_of_head], v[:, kv_of_head]
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + causal, dim=-1)
        attn = (probs @ v).transpose(1, 2).reshape(B, S, nh * hd)
        h = h + attn @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ sd[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_round_trip_is_exact():
    model = random_model()
    adapter = Llama3StateDictAdapter(ARGS)
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    assert "model.layers.1.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
    assert len(hf) == len(sd)
    # q/k rows are really permuted, other weights are only renamed.
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], sd["layers.0.feed_forward.w1.weight"])
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_hf_convention_forward_matches_ours():
    model = random_model()
    hf = Llama3StateDictAdapter(ARGS).to_hf(model.state_dict())
    tokens = torch.randint(0, ARGS.vocab_size, (2, 40))  # past original_max_position_embeddings
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_llama_forward(hf, to_hf_config(ARGS), tokens)
        unpermuted = {k: model.state_dict()[k2] for k, k2 in zip(hf, model.state_dict())}
        wrong = hf_llama_forward(unpermuted, to_hf_config(ARGS), tokens)
    # Two float32 forward passes (HF's rotate_half RoPE and names vs ours) through 2 blocks whose longest
    # contraction is the FFN's; sharp attention (q/k weights of std 0.5) amplifies: condition 4. Measured: uses 0.026 of
    # it (AVX-512), 0.026 (AVX2 caps).
    tol = logits_tol(ours, ARGS.n_layers, contraction_width(model, tokens.shape[1]), condition=4)
    torch.testing.assert_close(theirs, ours, **tol)
    # the permutation is needed, and the check can see it (the unpermuted weights move logits by O(1))
    assert (wrong - ours).abs().max() > 100 * tol["atol"]


def test_partial_state_dict_and_unknown_keys():
    adapter = Llama3StateDictAdapter(ARGS)
    sd = random_model().state_dict()
    stage = {k: v for k, v in sd.items() if k.startswith("layers.1.") or k == "output.weight"}
    assert set(adapter.to_hf(stage)) == {k for k in adapter.to_hf(sd) if ".layers.1." in k or k == "lm_head.weight"}
    with pytest.raises(KeyError):
        adapter.to_hf({"layers.0.attention.bogus.weight": torch.zeros(1)})
    with pytest.raises(KeyError):
        adapter.from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})
    assert adapter.from_hf({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}) == {}


@pytest.mark.parametrize("name", ["debugmodel", "8B", "70B", "405B"])
def test_config_round_trip(name):
    args = llama3_flavors[name]
    config = to_hf_config(args)
    back = from_hf_config(json.loads(json.dumps(config)))
    assert back.hidden_dim == args.hidden_dim
    # multiple_of / ffn_dim_multiplier are not recorded by HF; the hidden size is carried explicitly.
    expected = dataclasses.replace(
        args, ffn_hidden_dim=args.hidden_dim, multiple_of=TransformerModelArgs.multiple_of, ffn_dim_multiplier=None
    )
    assert back == expected


@pytest.mark.parametrize("layout", [4, 5])
def test_8b_config_values(layout):
    config = to_hf_config(llama3_flavors["8B"], layout=layout)
    assert config["intermediate_size"] == 14336
    assert config["num_key_value_heads"] == 8
    assert config["max_position_embeddings"] == 131072
    assert config["tie_word_embeddings"] is False
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    if layout == 4:
        assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 500000
        assert config["rope_scaling"] == scaling and "rope_parameters" not in config
    else:
        assert config["dtype"] == "bfloat16" and config["rope_parameters"] == {"rope_theta": 500000, **scaling}
        assert "rope_theta" not in config and "rope_scaling" not in config
    assert from_hf_config(config) == from_hf_config(to_hf_config(llama3_flavors["8B"], layout=9 - layout))


def test_save_load_round_trip(tmp_path):
    sd = random_model().state_dict()
    save_hf_folder(sd, Llama3StateDictAdapter, ARGS, str(tmp_path), dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    loaded, args = load_hf_folder(str(tmp_path), Llama3StateDictAdapter)
    assert args == dataclasses.replace(ARGS, ffn_hidden_dim=ARGS.hidden_dim, multiple_of=256, ffn_dim_multiplier=None)
    assert loaded.keys() == sd.keys()
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    # bf16 export rounds but keeps the values.
    save_hf_folder(sd, Llama3StateDictAdapter, ARGS, str(tmp_path / "bf16"))
    loaded16, _ = load_hf_folder(str(tmp_path / "bf16"), Llama3StateDictAdapter)
    assert all(loaded16[k].dtype == torch.bfloat16 for k in sd)
    assert all(torch.equal(loaded16[k], sd[k].bfloat16()) for k in sd)
    # The loaded args build a model that accepts the weights.
    model = Transformer(args)
    model.load_state_dict(loaded)


def test_load_sharded_and_tied(tmp_path):
    sd = random_model().state_dict()
    hf = Llama3StateDictAdapter(ARGS).to_hf(sd)
    del hf["lm_head.weight"]
    config = to_hf_config(ARGS) | {"tie_word_embeddings": True}
    names = sorted(hf)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: hf[k].contiguous() for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_hf_folder(str(tmp_path), Llama3StateDictAdapter)
    assert loaded.keys() == sd.keys()
    assert torch.equal(loaded["output.weight"], sd["tok_embeddings.weight"])
    assert all(torch.equal(loaded[k], sd[k]) for k in sd if k != "output.weight")
    assert not os.path.exists(tmp_path / "model.safetensors")
