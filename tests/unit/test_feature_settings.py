"""Compile, async TP and float8 settings that cannot run fail early with one line naming the fix."""

import pytest
import torch
import torch.nn as nn

from torchtitan.components.quantization import build_model_converters
from torchtitan.protocols.train_spec import config_manager
from torchtitan.distributed.compile import check_compile_config
from torchtitan.distributed.parallel_dims import parallel_dims_from_config

CPU = torch.device("cpu")


def _cfg(*argv: str):
    return config_manager().parse_args(list(argv))


def test_compile_settings():
    with pytest.raises(ValueError, match="compile.components optimizer unknown"):
        check_compile_config(_cfg("--compile.enable", "--compile.components", "model,optimizer"), "cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        check_compile_config(_cfg("--compile.enable", "--parallelism.enable_async_tensor_parallel"), "cpu")
    with pytest.raises(ValueError, match="compile.enable"):
        check_compile_config(_cfg("--parallelism.enable_async_tensor_parallel"), "cuda")
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        check_compile_config(_cfg("--compile.enable", "--parallelism.enable_async_tensor_parallel"), "cuda")
    with pytest.raises(ValueError, match="compile.backend 'tvm' unknown; choose from inductor, aot_eager"):
        check_compile_config(_cfg("--compile.enable", "--compile.backend", "tvm"), "cpu")
    check_compile_config(_cfg("--compile.enable"), "cpu")
    check_compile_config(_cfg("--compile.enable", "--compile.backend", "aot_eager"), "cpu")


def _converters(*argv: str, world_size: int = 1):
    cfg = _cfg("--model.converters", "float8", *argv)
    return build_model_converters(cfg, parallel_dims_from_config(cfg.parallelism, world_size), CPU)


def test_float8_settings():
    with pytest.raises(ValueError, match="float8.emulate"):
        _converters()  # CPU has no float8 tensor cores
    with pytest.raises(ValueError, match="tensorwise"):
        _converters("--float8.emulate", "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather")
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather"):
        _converters("--float8.emulate", "--float8.precompute_float8_dynamic_scale_for_fsdp")
    with pytest.raises(ValueError, match="unknown model converter 'float9'"):
        build_model_converters(_cfg("--model.converters", "float9"), parallel_dims_from_config(_cfg().parallelism, 1), CPU)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 64, bias=False)
        self.odd = nn.Linear(64, 10, bias=False)  # 10 is not a multiple of 16
        self.output = nn.Linear(64, 32, bias=False)


def test_float8_reports_and_never_converts_nothing():
    conv = _converters("--float8.emulate")
    model = _Toy()
    conv.convert(model)
    assert [type(m).__name__ for m in (model.proj, model.odd, model.output)] == ["Float8Linear", "Linear", "Linear"]
    # An emulated float8 matmul runs in float32, so MFU is measured against the fp32 peak.
    assert conv.matmul_dtype(torch.bfloat16) == torch.float32
    with pytest.raises(ValueError, match="converted none of the model's 3 linear layers"):
        _converters("--float8.emulate", "--float8.filter_fqns", "proj,output").convert(_Toy())
