"""The CP methods' communication: the formulas of planning/cp_comm.py equal the bytes the kernels' collectives
carry (counted by scripts/benchmarks/bench_cp_methods.py's wrapper, rank 0 of a fake 4-rank world), and the planner
picks the method the time model prefers and writes it into the recipe."""

import importlib.util
from pathlib import Path

import pytest

from torchtitan.planning.cp_comm import cp_block_time, cp_bytes_per_layer, cp_options
from torchtitan.planning.hardware import FLAT_NETWORK, get_device

_BENCH = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "bench_cp_methods.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cp_methods", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method,a2a,rotate,documents", [
    ("ring", 0, "alltoall", True), ("ring", 0, "allgather", False), ("ulysses", 0, "alltoall", True),
    ("hierarchical", 2, "alltoall", True), ("hierarchical", 2, "allgather", False),
])
def test_formula_equals_the_bytes_the_collectives_carry(method, a2a, rotate, documents):
    shape = dict(batch=2, seq=128, hq=4, hkv=1, d=8)  # 1 k/v head: ulysses repeats it to 4, hierarchical to 2
    counted = _bench().counted_bytes(method, 4, a2a, rotate, documents=documents, **shape)
    formula = cp_bytes_per_layer(method, 4, a2a, tokens=2 * 128 // 4, hq=4, hkv=1, d=8, act_bytes=4,
                                 rotate=rotate, documents=documents)
    assert counted == pytest.approx(formula, rel=1e-9) and counted > 0


def test_ulysses_bytes_shrink_with_cp_while_the_ring_grows():
    f = dict(tokens=131072, hq=32, hkv=8, d=128, act_bytes=2)  # tokens of the whole sequence, divided below
    ring = [cp_bytes_per_layer("ring", cp, 0, **{**f, "tokens": f["tokens"] // cp}) for cp in (2, 4, 8)]
    uly = [cp_bytes_per_layer("ulysses", cp, 0, **{**f, "tokens": f["tokens"] // cp}) for cp in (2, 4, 8)]
    assert ring[0] < ring[1] < ring[2] and uly[0] > uly[1] > uly[2]


def test_options_follow_the_heads_and_the_node():
    assert cp_options(8, 1, 32, 8) == [("ring", 0), ("ulysses", 0), ("hierarchical", 2), ("hierarchical", 4)]
    # 4 heads per rank: no ulysses over 8; a2a groups of 4 ranks x tp 2 fill the node, so still allowed.
    assert cp_options(8, 2, 8, 8) == [("ring", 0), ("hierarchical", 2), ("hierarchical", 4)]
    assert cp_options(8, 4, 16, 8) == [("ring", 0), ("hierarchical", 2)]


def test_planner_picks_the_fastest_method_and_writes_it():
    from torchtitan.planning.memory import ModelShape
    from torchtitan.planning.planner import Layout, evaluate

    device = get_device("H100-80GB")
    # Llama 3 8B's shape; cp 16 spans two nodes: ring k/v of the whole sequence cross the NICs.
    shape = ModelShape(dim=4096, hidden=14336, kv_dim=1024, n_heads=32, vocab=128256, n_layers=32)
    times = {opt: cp_block_time(device, FLAT_NETWORK, *opt, cp=16, tp=1, tokens=131072 // 16, n_heads=32,
                                kv_heads=8, head_dim=128, act_bytes=2) for opt in cp_options(16, 1, 32, 8)}
    best = min(times, key=times.get)
    assert times[("ring", 0)] > times[best]
    c = evaluate(shape, Layout(1, 1, 16, 1, 1, "full", 1), device, 16, 131072, 1)
    assert (c.layout.cp_method, c.layout.cp_a2a_degree) == best
    assert f'context_parallel_method = "{best[0]}"' in c.layout.toml(131072, 1)


def test_dry_run_reports_the_bytes_of_the_configured_method_and_the_others():
    from torchtitan.planning.dry_run import dry_run, format_report
    from torchtitan.protocols.train_spec import config_manager

    cfg = config_manager().parse_args([
        "--model.flavor", "debugmodel_tiny", "--training.seq_len", "2048", "--training.local_batch_size", "2",
        "--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method", "hierarchical",
        "--parallelism.context_parallel_a2a_degree", "2", "--training.mixed_precision_param", "float32"])
    report = dry_run(cfg, world_size=4)
    # debugmodel_tiny: 4 q heads, 2 kv heads of 16; 2 x 2048 / 4 = 1024 tokens per rank; fp32; allgather ring.
    f = dict(tokens=1024, hq=4, hkv=2, d=16, act_bytes=4, rotate="allgather")
    want = {m: cp_bytes_per_layer(m, 4, a, **f) / 2**20 for m, a in (("hierarchical", 2), ("ring", 0), ("ulysses", 0))}
    assert report.cp_comm == (f"context parallel hierarchical a2a 2 (cp 4): {want['hierarchical']:,.1f} MiB sent per "
                              f"rank per attention layer and microbatch (forward + backward); ring "
                              f"{want['ring']:,.1f} MiB, ulysses {want['ulysses']:,.1f} MiB")
    assert report.cp_comm in format_report(report) and min(want.values()) > 0.5
