"""Dry run on a fake process group: per-rank bytes equal what the layout gives by hand."""

import math

import torch

from torchtitan.protocols.train_spec import config_manager
from torchtitan.dry_run import main as dry_run_main
from torchtitan.planning.dry_run import compress_names, dry_run

# debugmodel_tiny: dim 64, 4 heads of 16, 2 kv heads, FFN hidden 192, vocab 2048 (shipped tokenizer).
DIM, KV, HIDDEN, VOCAB = 64, 32, 192, 2048
# (rows, cols) of each matrix of a block, and the norms
BLOCK_MATRICES = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (HIDDEN, DIM), (DIM, HIDDEN), (HIDDEN, DIM)]
BLOCK_NORMS = 2


def cfg(*args):
    return config_manager().parse_args(["--model.flavor", "debugmodel_tiny", "--training.seq_len", "64", *args])


def shard_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim-0 chunk `rank` of `world` (torch.chunk: ceil-sized chunks, the last ones shorter)."""
    size = math.ceil(rows / world)
    return max(0, min(size, rows - rank * size))


def fsdp_elems(world: int, rank: int, n_layers: int = 2, head: bool = True, tail: bool = True) -> int:
    n = 0
    for _ in range(n_layers):
        n += sum(shard_rows(r, world, rank) * c for r, c in BLOCK_MATRICES) + BLOCK_NORMS * shard_rows(DIM, world, rank)
    if head:
        n += shard_rows(VOCAB, world, rank) * DIM
    if tail:
        n += shard_rows(DIM, world, rank) + shard_rows(VOCAB, world, rank) * DIM
    return n


def test_fsdp_bytes_match_hand_count_including_uneven_shards():
    report = dry_run(cfg(), world_size=3, ranks=[0, 2])
    assert report.errors == []
    for r in report.ranks:
        elems = fsdp_elems(3, r.rank)
        assert r.num_params == elems
        assert r.param_bytes == r.grad_bytes == 4 * elems
        # AdamW: exp_avg + exp_avg_sq shaped like the shard, and a float32 step per parameter tensor
        assert r.optimizer_bytes == 8 * elems + 4 * (2 * 9 + 3)
    assert report.ranks[0].num_params != report.ranks[1].num_params  # 64 rows over 3 ranks: 22, 22, 20


def test_tp_x_fsdp_bytes_match_hand_count():
    report = dry_run(cfg("--parallelism.tensor_parallel_degree", "2"), world_size=8, ranks=[5])
    assert report.errors == [] and report.ranks[0].coordinates == {"dp_shard": 2, "tp": 1}
    # Every matrix (embedding, output included) is split 8 ways; norms are replicated over tp, sharded over 4.
    matrices = 2 * sum(r * c for r, c in BLOCK_MATRICES) + 2 * VOCAB * DIM
    norms = (2 * BLOCK_NORMS + 1) * DIM
    assert report.ranks[0].num_params == matrices // 8 + norms // 4


def test_pp_x_fsdp_stages_and_bytes_match_hand_count():
    c = cfg("--model.flavor", "debugmodel_tiny4", "--parallelism.pipeline_parallel_degree", "2",
            "--training.local_batch_size", "2")
    report = dry_run(c, world_size=4)  # default ranks: the first of each pp stage
    assert report.errors == [] and [r.rank for r in report.ranks] == [0, 2]
    first, last = report.ranks
    # 4 layers + 1 (embedding) + 1 (output) units over 2 stages: embedding + 2 layers | 2 layers + norm + output
    assert [s.modules for s in first.stages] == [("tok_embeddings", "layers.0-1")]
    assert [s.modules for s in last.stages] == [("layers.2-3", "norm", "output")]
    assert first.num_params == fsdp_elems(2, 0, n_layers=2, tail=False)
    assert last.num_params == fsdp_elems(2, 0, n_layers=2, head=False)


def test_optimizer_bytes_equal_a_real_adamw_state():
    report = dry_run(cfg(), world_size=1)
    from torchtitan.models.llama3 import Transformer

    model = Transformer(report.plan.model_args)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    assert report.ranks[0].optimizer_bytes == state
    assert report.ranks[0].param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_every_validation_error_is_one_line(capsys, tmp_path):
    missing = str(tmp_path / "nope.model")
    rc = dry_run_main(["--world-size", "6", "--model.flavor", "debugmodel_tiny", "--model.tokenizer_path", missing,
                       "--parallelism.tensor_parallel_degree", "3"])
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(errors) == 2, out
    assert "nope.model" in errors[0] and "vocab_size 2048" in errors[0]
    assert "tensor_parallel_degree 3" in errors[1]
    assert dry_run_main(["--world-size", "many"]) == 2


def test_compress_names():
    assert compress_names(["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.5", "norm"]) == (
        "tok_embeddings", "layers.0-2", "layers.5", "norm")


def test_balanced_split_mode_builds_through_the_real_pipeline_function():
    c = cfg("--model.flavor", "debugmodel_tiny4", "--parallelism.pipeline_parallel_degree", "2",
            "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_split", "balanced")
    report = dry_run(c, world_size=2)
    # The output (2048 x 64) costs ~2.3 blocks of debugmodel_tiny4, so the last stage keeps one block only.
    assert [s.modules for r in report.ranks for s in r.stages] == [
        ("tok_embeddings", "layers.0-2"), ("layers.3", "norm", "output")]


def test_a_rank_that_does_not_fit_the_device_is_an_error(capsys):
    """--device-type judges each rank's estimate against the GPU's memory, less --memory-headroom."""
    from torchtitan.planning.hardware import get_device

    big = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "8192", "--training.local_batch_size", "64"]
    h100 = get_device("H100-80GB")
    report = dry_run(config_manager().parse_args(big), world_size=1, device=h100)
    peak = report.ranks[0].memory.peak
    assert report.errors == [] and 0.1 * h100.memory_bytes < peak < 0.5 * h100.memory_bytes
    headroom = 1 - 0.9 * peak / h100.memory_bytes  # a limit 10% under the estimate
    report = dry_run(config_manager().parse_args(big), world_size=1, device=h100, memory_headroom=headroom)
    assert len(report.errors) == 1 and f"less {100 * headroom:.0f}% headroom" in report.errors[0]
    assert dry_run_main(["--world-size", "1", "--device-type", "H100-80GB", "--memory-headroom", f"{headroom}",
                         *big]) == 1
    assert "exceeds the H100-80GB's" in capsys.readouterr().out
    for bad, said in ((["--memory-headroom", "0.1"], "add --device-type"),
                      (["--device-type", "H100-80GB", "--memory-headroom", "1"], "fraction in [0, 1)"),
                      (["--device-type", "H100-80GB", "--memory-headroom", "lots"], "must be a number")):
        assert dry_run_main(["--world-size", "1", *bad, *big]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err


def test_the_dry_run_prints_each_ranks_memory_interval_and_flags_an_upper_end_above_the_device():
    """With --device-type, each rank's estimate comes with the interval the planner prints (where held-out
    published peaks lay beside such estimates); a rank that fits but whose upper end does not is flagged there,
    not made an error."""
    import dataclasses

    from torchtitan.planning.dry_run import format_report
    from torchtitan.planning.hardware import get_device
    from torchtitan.planning.held_out_error import HELD_OUT_MEMORY_RANGE, memory_interval

    job = config_manager().parse_args(["--model.flavor", "debugmodel_tiny", "--training.seq_len", "8192",
                                       "--training.local_batch_size", "8"])
    assert dry_run(job, world_size=1).memory_intervals == {}  # no device: no GPU allocator to compare with
    h100 = get_device("H100-80GB")
    peak = dry_run(job, world_size=1, device=h100).ranks[0].memory.peak
    # A device the estimate fits with 2% to spare: below the upper end (the estimate / 0.95 without PP).
    assert HELD_OUT_MEMORY_RANGE[False][0] < 1 / 1.02
    for memory, flagged in ((1.02 * peak, True), (2 * peak, False)):
        report = dry_run(job, world_size=1, device=dataclasses.replace(h100, memory_bytes=memory))
        assert report.errors == []
        low, high = memory_interval(report.ranks[0].memory, pipelined=False)
        assert low < report.ranks[0].memory.peak < high
        line = report.memory_intervals[0]
        assert line.startswith(f"memory interval {low / 2**30:.1f}-{high / 2**30:.1f} GiB")
        assert ("above the device's" in line) == flagged
        text = format_report(report)
        assert text.index(line) > text.index("estimated peak memory of rank 0")


def test_muon_optimizer_bytes_and_step_workspace_per_rank():
    """Muon keeps one momentum buffer per matrix (no step), AdamW's states for the rest; its step needs the
    gathered matrices the rank owns, which shrink with the world (owner_bytes' 1/N + largest)."""
    from torchtitan.components.optim.muon import default_is_muon_param
    from torchtitan.components.optim.muon_distributed import ns_workspace_bytes, owner_bytes

    report = dry_run(cfg("--optimizer.name", "Muon"), world_size=1)
    from torchtitan.models.llama3 import Transformer

    model = Transformer(report.plan.model_args)
    muon = [p for n, p in model.named_parameters() if default_is_muon_param(n, p)]
    rest = [p for n, p in model.named_parameters() if not default_is_muon_param(n, p)]
    assert muon and rest
    assert report.ranks[0].optimizer_bytes == sum(4 * p.numel() for p in muon) + sum(8 * p.numel() + 4 for p in rest)
    shapes = [tuple(p.shape) for p in muon]
    largest = max(a * b for a, b in shapes)
    total = sum(a * b for a, b in shapes)
    for world in (1, 2, 4):
        per_rank = [owner_bytes(shapes, world, r, 5, 4, 4)[0] for r in range(world)]
        bound = (total / world + largest) * 4 * (world > 1) + max(ns_workspace_bytes(s, 4, 4) for s in shapes)
        assert max(per_rank) <= bound, (world, per_rank, bound)
    assert max(owner_bytes(shapes, 4, r, 5, 4, 4)[0] for r in range(4)) < owner_bytes(shapes, 2, 0, 5, 4, 4)[0]


def test_muon_step_that_does_not_fit_is_one_line_naming_it():
    """A device that holds forward and backward but not the Muon step's gathered matrices: the error says
    Muon's step is what does not fit, names its largest matrix and the fixes."""
    from torchtitan.planning.hardware import Device

    args = ["--optimizer.name", "Muon", "--training.seq_len", "32", "--parallelism.data_parallel_shard_degree", "2",
            "--model.flavor", "debugmodel", "--model.overrides", "dim=1024,n_layers=8"]
    roomy = Device("roomy", 1e15, 1e12, 1e11, 1e11)
    report = dry_run(config_manager().parse_args(args), world_size=2, device=roomy)
    memory = report.ranks[0].memory
    muon = memory.components["Muon step (beyond backward)"]
    assert report.errors == [] and muon > 0.02 * memory.peak
    tight = Device("tight", 1e15, memory.peak - muon / 2, 1e11, 1e11)
    report = dry_run(config_manager().parse_args(args), world_size=2, device=tight)
    assert len(report.errors) == 1, report.errors
    line = report.errors[0]
    assert "only at Muon's optimizer step" in line and "layers." in line and "--optimizer.name AdamW" in line, line
    assert "\n" not in line


def test_split_backward_with_full_ac_says_the_estimate_does_not_model_it():
    """ZBV with full AC: the report carries the caveat beside its estimates (CPU: 0.66-0.78 of the measured
    peak); the same schedule without AC, and 1F1B with full AC, are modelled and carry none."""
    def caveat(*args):
        c = cfg("--model.flavor", "debugmodel_tiny4", "--parallelism.pipeline_parallel_degree", "2",
                "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "1", *args)
        return dry_run(c, world_size=2, ranks=[0]).memory_caveat

    full = ["--activation_checkpoint.mode", "full"]
    line = caveat("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", *full)
    assert line and "ZBVZeroBubble with full AC" in line and "1F1B" in line
    assert caveat("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble") is None
    assert caveat("--parallelism.pipeline_parallel_schedule", "1F1B", *full) is None


def test_the_slow_split_backward_pairs_are_named_once_for_the_trainer_and_the_dry_run():
    """split_backward_recompute: the line the trainer logs at start (and the dry run's caveat carries) for a
    split-backward schedule under AC that recomputes whole blocks; nothing for other schedules or AC modes."""
    from torchtitan.config.job_config import ActivationCheckpoint as AC
    from torchtitan.distributed.pipeline import SPLIT_BACKWARD, split_backward_recompute

    for schedule in SPLIT_BACKWARD:
        for ac in (AC(mode="full"), AC(mode="selective", selective_ac_option="2")):
            line = split_backward_recompute(schedule, ac)
            assert line and line.startswith(schedule) and "once per weight" in line and "\n" not in line
    for schedule, ac in (("ZBVZeroBubble", AC()), ("1F1B", AC(mode="full")), ("Interleaved1F1B", AC(mode="full")),
                         ("GPipe", AC(mode="selective", selective_ac_option="2"))):
        assert split_backward_recompute(schedule, ac) is None
    c = cfg("--model.flavor", "debugmodel_tiny4", "--parallelism.pipeline_parallel_degree", "2",
            "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble", "--activation_checkpoint.mode", "full")
    assert split_backward_recompute("InterleavedZeroBubble", AC(mode="full")) in dry_run(c, 2, ranks=[0]).memory_caveat


def test_a_split_backward_weight_pass_recomputes_a_checkpointed_block_once_per_weight():
    """What the caveat says of the weight pass, counted on torch's own split backward: a middle stage of two
    Llama blocks under the trainer's full AC runs each block's forward once in the input pass and then once per
    weight (9) in the weight pass, because stage_backward_weight differentiates each parameter group in its own
    autograd call and the non-reentrant checkpoint recomputes once per call. If torch changes this, the count
    (and the caveat) must change."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.protocols.train_spec import get_train_spec

    args = llama3_flavors["debugmodel_tiny"]
    torch.manual_seed(0)
    model = get_train_spec("llama3").model_cls(args)
    model.init_weights()
    model.tok_embeddings = None  # a stage whose input is hidden states that need a gradient
    forwards = []
    for name, block in model.layers.items():
        block.register_forward_pre_hook(lambda m, a, name=name: forwards.append(name))
    apply_ac(model, ActivationCheckpoint(mode="full"))
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    out = model(x)
    assert len(forwards) == len(model.layers) == 2
    forwards.clear()
    _, groups = stage_backward_input([out], [torch.randn_like(out)], [x], model.parameters())
    assert sorted(forwards) == ["0", "1"]  # the input pass: one recomputation per block
    forwards.clear()
    stage_backward_weight(model.parameters(), groups)
    weights = len(list(model.layers["0"].parameters()))
    assert weights == 9 and sorted(forwards) == ["0"] * weights + ["1"] * weights
