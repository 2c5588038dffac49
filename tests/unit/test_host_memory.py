"""A memory plan's host memory is counted against a node's RAM (--memory.host_gib): the dry run names it per
node beside the GPU memory and refuses a plan that exceeds it in one line; the layout planner skips such
layouts; on CPU the pre-flight check refuses a plan whose ranks do not fit this machine's (or the given) RAM.

The 405B case is docs/memory_budget.md's example: FSDP 128 x TP 2 on 256 H100s, a 60 GiB budget, whose plan
sends 104 block inputs (full_offload) to pinned host memory: 104 x (8,192 tokens x 2 sequences x 16,384 dim x 2
bytes / TP 2 = 0.25 GiB) = 26 GiB per GPU, x 8 GPUs per node = 208 GiB.
"""

from torchtitan import dry_run as dry_run_entry
from torchtitan.planning.hardware import get_device
from torchtitan.planning.memory import ModelShape
from torchtitan.planning.memory_budget import HostMemory
from torchtitan.planning.planner import plan_layouts
from torchtitan.protocols.model_shape import model_args_for
from torchtitan.protocols.train_spec import get_train_spec

DRY_405B = ["--world-size", "256", "--ranks", "0", "--device-type", "H100-80GB",
            "--job.config_file", "train_configs/llama3_405b.toml", "--parallelism.data_parallel_shard_degree", "128",
            "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2",
            "--training.global_batch_size", "256", "--activation_checkpoint.mode", "none", "--memory.budget_gib", "60"]


def test_405b_dry_run_names_host_memory_per_node_and_refuses_more_than_given(capsys):
    dry_run_entry.main(DRY_405B)
    out = capsys.readouterr().out
    plan = next(line for line in out.splitlines() if line.startswith("memory plan"))
    assert "blocks 0-103 full_offload, 104-125 full" in plan
    assert "GPU memory per rank 59.8 GiB, host memory per node: 208.0 GiB (26.00 GiB per rank of offloaded " \
           "activations x 8 ranks per node) (unchecked: give --memory.host_gib" in plan, plan
    assert "host memory than the node has" not in out

    assert dry_run_entry.main(DRY_405B + ["--memory.host_gib", "207"]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if "host memory than the node has" in line]
    assert len(errors) == 1 and errors[0].startswith("error: the memory plan needs more host memory"), errors
    assert "208.0 GiB" in errors[0] and "of 207.0 GiB (--memory.host_gib)" in errors[0]
    assert "--memory.plan_choices keep,op,full" in errors[0]  # the fix

    dry_run_entry.main(DRY_405B + ["--memory.host_gib", "208"])  # exactly enough: no host error
    assert "host memory than the node has" not in capsys.readouterr().out


def test_planner_skips_layouts_that_exceed_the_node_ram():
    args = model_args_for(get_train_spec("llama3"), "405B")
    shape, device = ModelShape.from_args(args), get_device("H100-80GB")
    run = dict(shape=shape, device=device, devices=256, seq_len=8192, global_batch_size=256,
               model_parallel=frozenset({"tp"}), budget_bytes=60 * 2**30)
    free = plan_layouts(**run)
    assert free.ranked[0].host_bytes == 26 * 2**30  # the example's #1: 104 inputs of 0.25 GiB
    limit = 128 * 2**30
    bounded = plan_layouts(**run, host_bytes=limit)
    assert bounded.dropped["does not fit host memory"] > 0
    assert all(c.host_bytes * device.gpus_per_node <= limit for c in bounded.ranked)
    over = [c for c in free.ranked if c.host_bytes * device.gpus_per_node > limit]
    assert len(bounded.ranked) == len(free.ranked) - len(over) and over


def test_host_memory_line_and_check():
    h = HostMemory(3 * 2**30, 8, 16 * 2**30, "--memory.host_gib")
    assert h.per_node == 24 * 2**30 and not h.fits
    assert h.line() == ("host memory per node: 24.0 GiB (3.00 GiB per rank of offloaded activations x 8 ranks "
                        "per node) of 16.0 GiB (--memory.host_gib)")
    assert HostMemory(2 * 2**30, 8, 16 * 2**30, "x").fits and HostMemory(10**15, 8, None, "unchecked").fits


def test_cpu_preflight_refuses_a_plan_beyond_the_given_ram(tmp_path, capsys):
    """On CPU the device is the host: the rank's whole predicted peak counts."""
    from torchtitan.preflight import main as preflight

    tiny = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "256", "--training.local_batch_size", "4",
            "--training.mixed_precision_param", "float32", "--job.dump_folder", str(tmp_path),
            "--memory.budget_gib", "1"]
    assert preflight(tiny) == 0  # this machine's RAM holds it
    assert "GiB (this machine's RAM)" in capsys.readouterr().out
    assert preflight(tiny + ["--memory.host_gib", "0.001"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the rank's predicted peak x 1 ranks per node) of 0.0 GiB" in err, err
