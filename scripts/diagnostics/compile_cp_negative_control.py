"""Negative control of the compiled-under-CP parity (tests/distributed/test_family_matrix.py, COMPILED_RTOL): a compiled
CP block whose attention kernel loses the ring (local causal SDPA in place of ring attention) must fail it.
Run from the repo root: PYTHONPATH=. python scripts/diagnostics/compile_cp_negative_control.py (about 2 min on 2 cores)."""
import os, sys, time
import pytest
from tests.multiprocess import free_port, run_ranks
from tests.distributed.test_family_matrix import _train_all, _losses, TWO_RANKS, COMPILED_RTOL


def broken_train_all(rank, world, runs, ports, folder):
    import torch.nn.functional as F
    import torchtitan.distributed.parallelize as par

    real = par.apply_compile

    def broken(model, *, eager=(), apart=(), backend="inductor"):
        for m in eager:  # the compiled block loses the ring: each rank attends within its own slice
            m.forward = lambda q, k, v, *a, **kw: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        real(model, eager=eager, apart=apart, backend=backend)

    par.apply_compile = broken
    return _train_all(rank, world, runs, ports, folder)


if __name__ == "__main__":
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), "compile_cp_negative_control_%d") % int(time.time() * 1000)
    os.makedirs(folder)
    cp = TWO_RANKS["cp2"] + ["--training.mixed_precision_param", "float32"]
    comp = [("llama3", "cp2_compiled", cp + ["--compile.enable", "--compile.backend", "aot_eager"])]
    eager = [("llama3", "cp2_eager", cp)]
    run_ranks(broken_train_all, 2, comp, [free_port()], folder, timeout=900)
    run_ranks(_train_all, 2, eager, [free_port()], folder, timeout=900)
    a, b = _losses(f"{folder}/llama3_cp2_compiled"), _losses(f"{folder}/llama3_cp2_eager")
    print("broken compiled", a, "eager", b, "parity holds:", a == pytest.approx(b, rel=COMPILED_RTOL))
