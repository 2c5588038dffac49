"""The layout planner: published layouts, paste-able output, memory limits, one-line errors."""

import dataclasses
import statistics
from types import SimpleNamespace

import pytest

from torchtitan.protocols.train_spec import config_manager
from torchtitan.job_plan import plan_job
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.plan import main as plan_main
from torchtitan.planning.hardware import get_device
from torchtitan.planning import planner
from torchtitan.planning.memory import ModelShape, block_elems_per_token, estimate_memory
from torchtitan.planning.planner import Features, Layout, evaluate, module_seconds_per_microbatch, plan_layouts
from torchtitan.planning.step_time import (
    ASYNC_TP_HIDDEN,
    LATENCY_S,
    LINK_EFFICIENCY,
    collective_time,
)
from torchtitan.planning.hardware import H100_500W_CLOCK_FRACTION
from torchtitan.planning.held_out_error import (
    HELD_OUT_MEDIAN_ERROR,
    HELD_OUT_MEMORY_RANGE,
    HELD_OUT_RATIO_RANGE,
    memory_interval,
)
from torchtitan.planning.published import (
    CORPUS,
    HELD_OUT,
    PUBLISHED,
    TIE,
    TRAINING,
    compare,
    fit_constants,
    single_choice_pairs,
)
from torchtitan.planning.step_time import CP_RING_STEP_OVERHEAD, TRAINING_KERNEL_EFF, BlockShape, block_seconds

H100 = get_device("H100-80GB")


def shape(flavor):
    return ModelShape.from_args(llama3_flavors[flavor])


COMPARISONS = {}


def comparison(case):
    if case.name not in COMPARISONS:  # each case is planned once for the tests below
        COMPARISONS[case.name] = compare(case)
    return COMPARISONS[case.name]


@pytest.mark.parametrize("case", PUBLISHED, ids=lambda c: c.name)
def test_published_layout_is_first_or_tied_or_its_gap_is_explained(case):
    """The published degrees come out first, or within TIE of the first (a tie the model cannot resolve),
    or else within 30% with the reason printed (compare(); scripts/planning/published_layouts.py). The 70B and
    405B runs of torchtitan's tables rank far down: the model finds FSDP alone (or with TP 2) faster at 256 and
    512 GPUs, because TP 8's collectives are exposed; those runs chose TP and PP for reasons it does not
    judge (docs/planning.md)."""
    c = comparison(case)
    print(f"{case.name}: rank {c.rank}, +{100 * c.gap:.1f}%: {c.reason}")
    assert c.rank is not None, f"the published layout {case.describe()} was dropped"
    if c.rank == 1 or c.gap < TIE:
        return
    assert c.gap < 0.30
    # The reason names the step-time terms that differ, largest first (and, under PP, the memory limit that
    # keeps the published degrees from the finer interleaving that would shrink their bubble).
    assert "seconds per step, published degrees vs #1: " in c.reason
    if case.pp > 1 and "bubble" in c.reason.split("vs #1: ")[1].split(",")[0]:
        assert "do not fit" in c.reason


def test_published_cases_where_the_planner_agrees():
    """Which cases come out first or tied (docs/planning.md explains those that do not), stated so that a
    model change that moves them shows here."""
    agree = {case.name: comparison(case).rank == 1 or comparison(case).gap < TIE for case in PUBLISHED}
    assert agree == {"Llama 3.1 8B, 8 H100": True, "Llama 3.1 8B, 128 H100": True, "Llama 3.1 70B, 256 H100": False,
                     "Llama 3.1 405B, 512 H100": False, "Llama 3 405B, 16K H100": True,
                     "Llama 3 405B, 8K H100": False}
    # Given the parallelisms each run composed (--parallelisms), the planner picks its degrees in more cases.
    within = {case.name: comparison(case).within[0] == 1 or comparison(case).within[1] < TIE for case in PUBLISHED}
    assert within == {"Llama 3.1 8B, 8 H100": True, "Llama 3.1 8B, 128 H100": True, "Llama 3.1 70B, 256 H100": False,
                      "Llama 3.1 405B, 512 H100": False, "Llama 3 405B, 16K H100": True,
                      "Llama 3 405B, 8K H100": True}


@pytest.mark.parametrize("pair", single_choice_pairs(), ids=lambda p: f"{p[2]}: {p[0].name} -> {p[1].name}")
def test_published_pairs_that_differ_in_one_choice_are_ordered_as_published(pair):
    """The ranking rests on relative predictions: for each published pair at one setting that differs in one
    choice (layout, schedule, AC, compile, Float8, async TP), the model orders the two as the published
    numbers do, or calls a tie (their predicted throughputs within TIE of each other)."""
    a, b, what = pair
    published = b.tokens_per_s / a.tokens_per_s
    predicted = b.predict().tokens_per_s_per_device / a.predict().tokens_per_s_per_device
    print(f"{what}: published x{published:.3f}, predicted x{predicted:.3f}")
    assert (predicted > 1) == (published > 1) or abs(predicted - 1) < TIE


def test_the_corpus_has_the_pairs_the_issue_names():
    """Every kind of single choice the corpus can pair is found (a pairing bug would silently drop tests)."""
    kinds = {what for _, _, what in single_choice_pairs()}
    assert kinds == {"compile", "float8", "async_tp", "schedule", "ac"}
    assert len(CORPUS) >= 30 and set(TRAINING).isdisjoint(HELD_OUT) and len(TRAINING) + len(HELD_OUT) == len(CORPUS)


def test_the_stored_constants_are_the_fit_on_the_training_half():
    """The fitted constants in step_time.py / hardware.py are what fit_constants gives from TRAINING alone
    (the fitting rule: every other run in corpus order), so nobody tunes them by hand against HELD_OUT."""
    assert fit_constants() == {"TRAINING_KERNEL_EFF": TRAINING_KERNEL_EFF,
                               "H100_500W_CLOCK_FRACTION": H100_500W_CLOCK_FRACTION,
                               "CP_RING_STEP_OVERHEAD": CP_RING_STEP_OVERHEAD}


HELD_OUT_MEMORY_MISSES = {"T6 405B 512 GPUs FSDP 4 CP 2 seq 65536", "T6 405B 512 GPUs FSDP 1 CP 8 seq 262144"}
"""Held-out runs whose published memory the estimator misses by more than 10%, both under: the 405B runs with
PP 8 x TP 8 + Float8 + async TP + compile hold 10-13 GiB more than estimated on their first pipeline stage at
every CP degree, their training twins (T5 1F1B, T6 CP 1 and 4) as much, so a term is missing, not noise; it was
not identified without a GPU profile of that code (docs/planning.md, "Cases it still misses"). Named so that a
change that fixes one or adds one shows."""


def test_held_out_runs_meet_the_issues_criteria():
    """The issue's criteria on the runs the fit never saw (HELD_OUT: every other run of the corpus):
    every run's predicted tokens/s/GPU within 15% of the published figure, the median within 10%, and peak
    memory within 10% where published (the allocator's reserved bytes, what torchtitan logs) except the runs
    HELD_OUT_MEMORY_MISSES names. The interval the planner prints comes from these ratios
    (HELD_OUT_RATIO_RANGE). Pure arithmetic over 19 runs: well under a second."""
    ratios = {r.name: r.predict().tokens_per_s_per_device / r.tokens_per_s for r in HELD_OUT}
    for name, ratio in ratios.items():
        print(f"{name}: predicted / published {ratio:.3f}")
    assert {n for n, x in ratios.items() if abs(x - 1) > 0.15} == set()
    assert statistics.median(abs(x - 1) for x in ratios.values()) <= min(0.10, HELD_OUT_MEDIAN_ERROR)
    lo, hi = HELD_OUT_RATIO_RANGE
    assert lo <= min(ratios.values()) and max(ratios.values()) <= hi
    assert min(ratios.values()) - lo < 0.01 and hi - max(ratios.values()) < 0.01  # the range is not padded
    memory = {r.name: r.predict().memory.allocator_reserved / 2**30 / r.memory_gib for r in HELD_OUT if r.memory_gib}
    print(memory)
    assert len(memory) == 10
    assert {n for n, x in memory.items() if abs(x - 1) > 0.10} == HELD_OUT_MEMORY_MISSES
    # the memory interval the planner prints comes from these ratios, split by whether the run pipelines
    for pipelined, (lo, hi) in HELD_OUT_MEMORY_RANGE.items():
        side = [x for r in HELD_OUT if r.memory_gib and (r.layout.pp > 1) == pipelined for x in [memory[r.name]]]
        assert len(side) >= 3 and lo <= min(side) and max(side) <= hi
        assert min(side) - lo < 0.01 and hi - max(side) < 0.01


def test_the_heaviest_pipeline_rank_decides_whether_a_layout_fits():
    """Interleaved 1F1B with as many microbatches as ranks runs every forward before the first backward on
    the first ranks; rank 0's first stage is only the embedding, so rank 1 (all blocks) is the heaviest."""
    layout = Layout(16, 8, 1, 8, 16, "op", 16, 1, "Interleaved1F1B", 1, 2)
    roomy = get_device("H200-141GB")
    c = evaluate(shape("405B"), layout, roomy, 16384, 8192, 2048)
    # rank 1: 4 stages of 2 blocks, all 16 microbatches' forwards in flight (rank 0 holds 7 blocks)
    by_hand = 16 * 8 * 8192 * block_elems_per_token(shape("405B"), "op", tp=8) * 2
    assert c.memory.components["activations"] == pytest.approx(by_hand, rel=1e-6)
    # (of its 4 stages' gradients, fp32, only the last stage's exist at that moment: RankWork.pp_moments)
    assert c.memory.components["FSDP unsharded gradients"] == pytest.approx(
        c.memory.components["FSDP gathered stage (PP)"] / 2 * 4 / 4, rel=0.01)
    assert c.memory.peak > 0.9 * get_device("H100-80GB").memory_bytes
    with pytest.raises(MemoryError):
        evaluate(shape("405B"), layout, get_device("H100-80GB"), 16384, 8192, 2048, memory_headroom=0.1)


@pytest.mark.parametrize("case", PUBLISHED, ids=lambda c: c.name)
def test_published_throughput_is_predicted_within_2x(case):
    c = comparison(case)
    predicted = c.result.ranked[c.rank - 1].tokens_per_s_per_device
    assert 0.5 < predicted / case.tokens_per_s < 2.0


def test_pipeline_with_fsdp_holds_the_gathered_stage_and_its_fp32_gradients():
    """torch's PipelineStage keeps a stage gathered with unsharded fp32 gradients for the whole step, and a
    receive buffer per microbatch: 2 + 4 bytes per stage parameter (after TP) on top of the shards."""
    layout = Layout(1, 8, 1, 8, 8, "full", 32, 1, "1F1B")
    est = evaluate(shape("405B"), layout, get_device("H100-96GB"), 512, 8192, 256).memory.components
    # The heaviest pp rank's fp32 parameter shard is 1/8 (fsdp) of its stage: the gathered bf16 stage is 4x
    # that shard's bytes, the unsharded fp32 gradients 8x; the sharded gradients do not exist yet.
    assert est["FSDP gathered stage (PP)"] == pytest.approx(4 * est["parameters"], rel=1e-6)
    assert est["FSDP unsharded gradients"] == pytest.approx(8 * est["parameters"], rel=1e-6)
    assert est["gradients"] == 0 and est["FSDP gather/reduce buffers"] == 0
    s = shape("405B")
    # the first (last) rank receives only gradients (activations): one per microbatch, sequence-parallel bf16
    assert est["PP receive buffers"] == 32 * 8192 * s.dim // 8 * 2


def test_the_last_stage_keeps_its_outputs_as_torch_did_before_2025(monkeypatch):
    """torch's pipeline schedules before `return_outputs` (2025) kept every microbatch's logits on the last stage
    until the step ended, then concatenated them (the published 405B runs' torch): the last rank holds n - 1
    earlier outputs beside the last microbatch's, and 2 n at the step's end. This repository's trainer does
    not keep them (return_outputs=False), so the planner's own layouts carry no such term. (Measured on CPU:
    scripts/planning/bench_memory.py rows "outputs kept", estimate / measured 0.999.)"""
    layout = Layout(1, 8, 1, 8, 8, "full", 32, 4, "1F1B")
    s = shape("405B")
    ranks = []  # every pipeline rank the planner judges, in its order (rank 0 first, the last rank last)

    def recorded(*args):
        ranks.append(estimate_memory(*args))
        return ranks[-1]

    monkeypatch.setattr(planner, "estimate_memory", recorded)
    evaluate(s, layout, get_device("H100-96GB"), 512, 8192, 256, pp_outputs_kept=True)
    monkeypatch.undo()
    last = ranks[-1].components
    logits = 4 * 8192 * (s.vocab // 8) * 2  # one microbatch of 4 sequences, vocabulary over TP 8, bf16
    assert last["PP outputs kept (last stage)"] == 7 * logits
    assert ranks[0].components.get("PP outputs kept (last stage)", 0) == 0  # only the rank with the output
    plain = evaluate(s, layout, get_device("H100-96GB"), 512, 8192, 256).memory.components
    assert "PP outputs kept (last stage)" not in plain


def test_the_405b_memory_pairs_a_tensor_estimate_can_and_cannot_follow(monkeypatch):
    """docs/planning.md, "Cases it still misses": T5 1F1B and T6 CP 1 hold equal tensors on every pipeline rank the
    planner judges, yet report 7 GiB apart, so an estimate built from tensors can sit between them but not follow
    the difference. T5 Interleaved 1F1B reports 9.8 GiB less than T5 1F1B, and the estimate orders them so too:
    its first rank makes its later stage's gradients first, while the most activations are alive, and the
    earlier stage's only after half of those are freed (RankWork.pp_moments), 3 GiB less than 1F1B's first
    rank even with the 16 stage outputs its sends hold (RankWork.pp_sends_held); its peak rank (the last, with the kept outputs) is within 10% of the published figure."""
    by_name = {r.name: r for r in CORPUS}

    def ranks(run):
        seen = []

        def recorded(*args):
            seen.append(estimate_memory(*args))
            return seen[-1]

        monkeypatch.setattr(planner, "estimate_memory", recorded)
        run.predict()
        monkeypatch.undo()
        return [e.allocator_reserved / 2**30 for e in seen]

    one_f1b, cp1 = by_name["T5 405B 512 GPUs 1F1B"], by_name["T6 405B 512 GPUs FSDP 8 CP 1 seq 32768"]
    interleaved = by_name["T5 405B 512 GPUs Interleaved 1F1B"]
    assert ranks(one_f1b) == ranks(cp1)
    assert one_f1b.memory_gib - cp1.memory_gib > 7
    assert one_f1b.memory_gib - interleaved.memory_gib > 9
    assert 2 < ranks(one_f1b)[0] - ranks(interleaved)[0] < 10
    assert 0.9 <= max(ranks(interleaved)) / interleaved.memory_gib <= 1.1


def test_the_busiest_pipeline_rank_sets_the_pace():
    """8B's output projection and loss weigh ~1.7 blocks at 8K (attention and element-wise kernels count in a
    block, not in the output): a 2-stage pipeline's last rank does more than half."""
    even = evaluate(shape("8B"), Layout(1, 1, 1, 1, 2, "op", 16, 1, "1F1B"), get_device("H200-141GB"), 2, 8192, 16)
    flat = evaluate(shape("8B"), Layout(1, 2, 1, 1, 1, "op", 1, 1, "", 8), get_device("H200-141GB"), 2, 8192, 16)
    assert even.time.compute > 1.03 * flat.time.compute


def test_the_printed_toml_is_a_valid_recipe_for_the_world(tmp_path):
    best = plan_layouts(shape("70B"), H100, 256, 8192, 256).ranked[0].layout
    recipe = tmp_path / "plan.toml"
    recipe.write_text('[model]\nflavor = "70B"\n\n' + best.toml(8192, 256))
    cfg = config_manager().parse_args(["--job.config_file", str(recipe)])
    plan = plan_job(cfg, 256, SimpleNamespace(vocab_size=128256))
    pd = plan.parallel_dims
    assert (pd.tp, pd.pp, pd.dp_shard, pd.dp_replicate) == (best.tp, best.pp, best.dp_shard, best.dp_replicate)


def test_layouts_that_do_not_fit_are_dropped():
    # 405B on one node: 405e9 x 16 bytes of model state over 8 GPUs cannot fit in 80 GB each.
    result = plan_layouts(shape("405B"), H100, 8, 8192, 8)
    assert result.ranked == [] and result.dropped["does not fit memory"] > 0
    with pytest.raises(MemoryError):
        evaluate(shape("70B"), Layout(1, 8, 1, 1, 1, "none", 1), H100, 8, 8192, 8)


def test_cli_prints_top_layouts_and_one_line_errors(capsys):
    assert plan_main(["--flavor", "8B", "--devices", "8", "--seq-len", "8192", "--global-batch-size", "16",
                      "--device-type", "H100-96GB", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "#1 (fastest; " in out and "#2" in out and "data_parallel_shard_degree = " in out
    # each layout carries the interval the held-out runs give, and the published run at this setting is placed
    assert "held-out predicted / published 0.86-1.14" in out and " tokens/s/device): " in out
    assert "published (T1 8B 8 GPUs FSDP; training): dp_shard 8" in out
    # and the range of memory the held-out runs published beside such estimates
    assert "peak memory estimated / published 0.95-1.07 without PP, 0.75-0.96 with" in out
    assert out.count("  memory interval ") == 2


def test_the_memory_interval_flags_a_layout_whose_upper_end_exceeds_the_device(capsys):
    """A layout whose estimate fits but whose held-out memory interval reaches past the device's memory says
    so; the interval is the estimate's allocator share over the held-out ratios (with or without PP), the CUDA
    runtime added back; the headroom the header names keeps the upper ends of the layouts it keeps in memory."""
    s, args = shape("8B"), (8, 8192, 16)
    ranked = plan_layouts(s, H100, *args).ranked
    intervals = [memory_interval(c.memory, c.layout.pp > 1) for c in ranked]
    for c, (low, high) in zip(ranked, intervals):
        lo, hi = HELD_OUT_MEMORY_RANGE[c.layout.pp > 1]
        runtime = c.memory.peak - c.memory.allocator_reserved
        assert (low, high) == pytest.approx((c.memory.allocator_reserved / hi + runtime,
                                             c.memory.allocator_reserved / lo + runtime))
    over = [i for i, (_, high) in enumerate(intervals[:3]) if high > H100.memory_bytes]
    assert over and len(over) < 3  # among the first three, some reach past 74.5 GiB and some do not
    assert plan_main(["--flavor", "8B", "--devices", "8", "--seq-len", "8192", "--global-batch-size", "16",
                      "--top", "3"]) == 0
    out = capsys.readouterr().out
    for i, (low, high) in enumerate(intervals[:3]):
        line = f"  memory interval {low / 2**30:.1f}-{high / 2**30:.1f} GiB"
        assert line + (": above the device's 74.5 GiB at the upper end\n" if i in over else "\n") in out
    for pipelined in (False, True):
        kept = plan_layouts(s, H100, *args, memory_headroom=1 - HELD_OUT_MEMORY_RANGE[pipelined][0]).ranked
        side = [c for c in kept if (c.layout.pp > 1) == pipelined]
        assert side and all(memory_interval(c.memory, pipelined)[1] <= H100.memory_bytes for c in side)



def test_a_group_with_several_members_per_node_uses_their_nics():
    """Each GPU has its own NIC and NCCL spreads its rings over them: 16 ranks filling 2 nodes move 8 NICs'
    worth (capped by NVLink), 16 ranks one per node (stride 8) one NIC's."""
    gb = 1e9
    packed = collective_time(H100, 16, gb, span=16)
    strided = collective_time(H100, 16, gb, span=128)
    one_nic = (15 / 16) * gb / (H100.inter_node_bw * LINK_EFFICIENCY["inter"])
    assert strided == pytest.approx(15 * LATENCY_S["inter"] + one_nic)
    assert packed == pytest.approx(15 * LATENCY_S["inter"] + one_nic / 8)
    assert collective_time(H100, 8, gb, span=8) < packed  # inside a node: NVLink


def test_fsdp_gathers_and_reduction_share_the_link_in_backward():
    """When the backward's gathers plus the gradient reduction take longer than the backward's compute, the
    excess is exposed, even though each alone would hide behind its phase (the link carries both)."""
    s, layout = shape("8B"), Layout(1, 16, 1, 1, 1, "none", 1)
    compute = evaluate(s, layout, get_device("H200-141GB"), 16, 8192, 16).time.compute  # no FSDP exposure
    units, fwd, bwd = s.n_layers + 1, compute / 3, compute * 2 / 3
    # one GPU per node, with a NIC slow enough that a block's gather takes 0.28 of compute / units
    bw = (15 / 16) * s.block_params * 2 / (0.28 * compute / units) / LINK_EFFICIENCY["inter"]
    slow = dataclasses.replace(get_device("H200-141GB"), gpus_per_node=1, inter_node_bw=bw)
    c = evaluate(s, layout, slow, 16, 8192, 16)
    ag = collective_time(slow, 16, s.block_params * 2, 16)
    rs = collective_time(slow, 16, s.block_params * 4, 16)
    assert units * ag < fwd and units * ag < bwd and units * rs < bwd  # alone, each would hide
    assert units * (ag + rs) > bwd  # together the backward's do not
    assert c.time.compute == pytest.approx(compute)
    assert c.time.exposed["FSDP/HSDP"] == pytest.approx(units * (ag + rs) - bwd + ag + rs, rel=1e-9)


def test_float8_speeds_up_the_blocks_linears_only():
    """Float8 changes the blocks' matmuls (float8 peak) and adds their casts; attention, element-wise kernels and
    the bf16 output projection are priced the same."""
    s = shape("8B")
    h200 = get_device("H200-141GB")
    plain = module_seconds_per_microbatch(s, h200, 8192, 16384, 1, 1, "op", Features(compile=True))
    f8 = module_seconds_per_microbatch(s, h200, 8192, 16384, 1, 1, "op", Features(float8=True))
    assert f8["output"] == plain["output"] and f8["layers.0"] < plain["layers.0"]
    b = BlockShape(s.dim, s.dim, s.kv_dim, s.hidden)
    args = (h200, b, 16384, 8192, 1, 1, "op", True)
    kinds_plain, kinds_f8 = block_seconds(*args, False, False), block_seconds(*args, True, False)
    assert {k: v for k, v in kinds_f8.items() if k not in ("matmul", "float8 casts")} == \
        {k: v for k, v in kinds_plain.items() if k not in ("matmul", "float8 casts")}
    assert kinds_plain["float8 casts"] == 0 < kinds_f8["float8 casts"]
    # float8 all-gather moves the forward's weight cast before the gather: less cast traffic per microbatch
    assert block_seconds(*args, True, True)["float8 casts"] < kinds_f8["float8 casts"]


def test_async_tp_hides_a_stated_share_of_tp_traffic():
    layout = Layout(1, 32, 1, 8, 1, "full", 16)
    args = (shape("70B"), layout, get_device("H200-141GB"), 256, 8192, 512)
    plain = evaluate(*args).time.exposed["TP"]
    overlapped = evaluate(*args, features=Features(async_tp=True)).time.exposed["TP"]
    assert overlapped == pytest.approx((1 - ASYNC_TP_HIDDEN) * plain, rel=1e-9)


def test_planned_features_become_recipe_lines(tmp_path):
    features = Features(float8=True, float8_all_gather=True, async_tp=True)
    layout = Layout(1, 32, 1, 8, 1, "full", 16)
    recipe = tmp_path / "plan.toml"
    recipe.write_text(layout.toml(8192, 512, features).replace('[model]\n', '[model]\nflavor = "70B"\n'))
    cfg = config_manager().parse_args(["--job.config_file", str(recipe)])
    assert cfg.model.converters == ["float8"] and cfg.float8.enable_fsdp_float8_all_gather
    assert cfg.parallelism.enable_async_tensor_parallel and cfg.compile.enable
    assert "async" not in Layout(1, 8, 1, 1, 1, "op", 2).toml(8192, 16, features)  # no TP, no async TP
    assert "[compile]" in Layout(1, 8, 1, 1, 1, "op", 2).toml(8192, 16, Features(float8=True))
    assert "[compile]" not in Layout(1, 8, 1, 1, 1, "op", 2).toml(8192, 16, Features(async_tp=True))


def test_cli_refuses_float8_all_gather_without_float8(capsys):
    assert plan_main(["--flavor", "8B", "--devices", "8", "--seq-len", "8192", "--global-batch-size", "16",
                      "--float8-all-gather"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --float8" in err


def test_cli_keeps_the_parallelisms_asked_for(capsys):
    args = ["--flavor", "70B", "--devices", "64", "--seq-len", "8192", "--global-batch-size", "64", "--top", "3"]
    assert plan_main(args + ["--parallelisms", "tp"]) == 0
    out = capsys.readouterr().out
    picks = [line for line in out.splitlines() if line.startswith("#")]
    assert len(picks) == 3 and all(" x tp " in p and "pp " not in p and "cp " not in p for p in picks)
    assert plan_main(args + ["--parallelisms", "tp,xp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown xp" in err


def test_memory_headroom_drops_exactly_the_layouts_above_the_lowered_limit(capsys):
    """--memory-headroom h keeps a layout iff its estimated peak <= (1 - h) x the device's memory; the ones it
    keeps are ranked as before."""
    s, args = shape("8B"), (8, 8192, 16)
    free = plan_layouts(s, H100, *args)
    kept = plan_layouts(s, H100, *args, memory_headroom=0.2)
    limit = 0.8 * H100.memory_bytes
    assert 0 < len(kept.ranked) < len(free.ranked)
    assert [c.layout for c in kept.ranked] == [c.layout for c in free.ranked if c.memory.peak <= limit]
    assert kept.dropped["does not fit memory"] == free.dropped["does not fit memory"] + (
        len(free.ranked) - len(kept.ranked))
    over = next(c.layout for c in free.ranked if c.memory.peak > limit)
    with pytest.raises(MemoryError, match="less 20% headroom"):
        evaluate(s, over, H100, *args, memory_headroom=0.2)
    cli = ["--flavor", "8B", "--devices", "8", "--seq-len", "8192", "--global-batch-size", "16"]
    assert plan_main(cli + ["--memory-headroom", "0.2", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{len(kept.ranked)} layouts fit within 59.6 GiB (20% of memory kept free)" in out
    assert kept.ranked[0].layout.describe() in out
    assert plan_main(cli + ["--memory-headroom", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory-headroom must be a fraction in [0, 1)" in err


def test_a_memory_budget_plans_each_layout_per_block(tmp_path, capsys):
    """--memory-budget-gib (the trainer's --memory.budget_gib): every layout kept stays within the budget,
    each is also judged with the memory-budget planner's per-block mix of keep/op/full/offload/full_offload,
    which lets a layout fit where selective AC does not and run faster than full AC there (or fit where neither
    does, by offloading); its recipe carries the budget and the trainer's own planner meets it for that layout."""
    s, args, budget = shape("8B"), (8, 8192, 16), 30 * 2**30
    free = plan_layouts(s, H100, *args)
    res = plan_layouts(s, H100, *args, budget_bytes=budget)
    assert res.ranked and all(c.memory.peak <= budget for c in res.ranked)
    assert res.dropped["does not fit memory"] > free.dropped["does not fit memory"]
    planned = [c for c in res.ranked if c.layout.ac == "budget"]
    assert planned and all(0 < len(c.layout.block_plan) <= 32 // c.layout.pp for c in planned)
    wins = []
    for c in planned:
        uniform = dataclasses.replace(c.layout, ac="op", budget_gib=0.0, block_plan=())
        try:
            evaluate(s, uniform, H100, *args, budget_bytes=budget)
        except MemoryError:  # selective AC does not fit this layout: is the plan faster than full AC?
            try:
                full = evaluate(s, dataclasses.replace(uniform, ac="full"), H100, *args, budget_bytes=budget)
            except MemoryError:  # nor does full AC: some rank's plan offloads (full_offload keeps no block input);
                # the layout records the first rank's choices, host_bytes the busiest rank's offloaded bytes
                assert {"offload", "full_offload"} & set(c.layout.block_plan) or c.host_bytes > 0, c.layout
                continue
            wins.append(c.time.total < full.time.total)
    assert wins and all(wins)
    best = planned[0].layout
    recipe = tmp_path / "plan.toml"
    recipe.write_text('[model]\nflavor = "8B"\n\n' + best.toml(*args[1:]))
    cfg = config_manager().parse_args(["--job.config_file", str(recipe)])
    assert cfg.memory.budget_gib == 30 and cfg.activation_checkpoint.mode == "none"
    from torchtitan.planning.memory_budget import plan_budget

    trainer = plan_budget(cfg, plan_job(cfg, 8, SimpleNamespace(vocab_size=128256)), flops=H100.bf16_flops,
                          on_gpu=True)
    assert trainer.memory.peak <= budget
    cli = ["--flavor", "8B", "--devices", "8", "--seq-len", "8192", "--global-batch-size", "16", "--top", "1"]
    assert plan_main(cli + ["--memory.budget_gib", "30"]) == 0
    out = capsys.readouterr().out
    assert f"{len(res.ranked)} layouts fit within a budget of 30 GiB per rank" in out
    assert res.ranked[0].layout.describe() in out
    assert plan_main(cli + ["--memory-budget-gib", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory-budget-gib -1 must be 0 (no budget) or a positive number" in err
    assert plan_main(cli + ["--memory-budget-gib", "1"]) == 1  # below the parameters of every layout
    assert "raise --memory-budget-gib" in capsys.readouterr().err
