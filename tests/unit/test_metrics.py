import json
import logging
import math

import pytest

from torchtitan.components.metrics import MetricsLogger, format_console_line, throughput_metrics
from torchtitan.config.job_config import Metrics
from torchtitan.tools.logging import init_logger, logger


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_written_flushed_and_parseable(tmp_path):
    metrics = MetricsLogger(str(tmp_path), Metrics(), rank=0)
    metrics.log(1, {"loss": 7.5, "lr": 8e-4})
    # Readable before close: a crash keeps what was logged.
    assert _read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 7.5, "lr": 8e-4}]
    metrics.log(2, {"loss": float("nan"), "validation/loss": 6.0})
    metrics.close()
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    assert lines[1]["step"] == 2 and math.isnan(lines[1]["loss"]) and lines[1]["validation/loss"] == 6.0


def test_rank_0_only_suppresses_other_ranks(tmp_path, caplog):
    metrics = MetricsLogger(str(tmp_path), Metrics(enable_tensorboard=True), rank=1)
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        metrics.log(1, {"loss": 1.0})
    metrics.close()
    assert list(tmp_path.iterdir()) == []
    assert caplog.text == ""


def test_every_rank_writes_its_own_files_when_not_rank_0_only(tmp_path):
    cfg = Metrics(rank_0_only=False, enable_tensorboard=True)
    for rank in (0, 1):
        metrics = MetricsLogger(str(tmp_path), cfg, rank=rank)
        metrics.log(1, {"loss": float(rank)})
        metrics.close()
    assert _read_jsonl(tmp_path / "metrics.jsonl")[0]["loss"] == 0.0
    assert _read_jsonl(tmp_path / "metrics_rank1.jsonl")[0]["loss"] == 1.0
    assert list((tmp_path / "tb" / "rank_1").glob("events.out.tfevents.*"))


def test_tensorboard_event_file(tmp_path):
    metrics = MetricsLogger(str(tmp_path), Metrics(enable_tensorboard=True, save_tb_folder="tbx"), rank=0)
    metrics.log(10, {"loss": 3.0})
    metrics.close()
    events = list((tmp_path / "tbx").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "torchtitan-test")
    # Keep wandb's own caches, settings and service logs out of the home directory.
    for var in ("XDG_CACHE_HOME", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    run_dir = tmp_path / "run"
    metrics = MetricsLogger(str(run_dir), Metrics(enable_wandb=True), rank=0, config_dict={"lr": 1e-3})
    metrics.log(1, {"loss": 2.0})
    metrics.close()
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_console_line_format():
    line = format_console_line(
        10,
        {
            "loss": 7.12341,
            "grad_norm": 1.23449,
            "lr": 8e-4,
            "memory/max_reserved_gib": 1.2,
            "memory/max_reserved_pct": 1.5,
            "memory/num_ooms": 0.0,
            "tps": 12345.4,
            "tflops": 1.234,
            "mfu": 4.561,
            "data_loading_pct": 1.23,
            "validation/loss": 6.5,
        },
        color=False,
    )
    assert line == (
        "step:  10  loss:  7.1234  grad_norm:  1.2345  lr: 8.0e-04  memory: 1.20GiB(1.5%)  tps: 12,345  "
        "tflops: 1.23  mfu: 4.56%  data: 1.2%  validation/loss=6.5"
    )
    assert "\033[" in format_console_line(1, {"loss": 1.0}, color=True)
    assert "memory: 0.50GiB rss" in format_console_line(1, {"memory/peak_rss_gib": 0.5}, color=False)


def test_console_line_logged(tmp_path, capsys):
    init_logger(rank=0)
    metrics = MetricsLogger(str(tmp_path), Metrics(disable_color_printing=True), rank=0)
    metrics.log(3, {"loss": 2.0})
    metrics.close()
    out = capsys.readouterr().out
    assert "[titan]" in out and " - INFO - step:   3  loss:  2.0000" in out
    for handler in list(logger.handlers):
        logger.removeHandler(handler)


def test_throughput_arithmetic():
    m = throughput_metrics(tokens=20_000, seconds=2.0, flops_per_token=6e9, peak_flops=1e14)
    assert m["tps"] == 10_000
    assert m["tflops"] == pytest.approx(60.0)
    assert m["mfu"] == pytest.approx(60.0)
    assert "mfu_above_100" not in m
    # Never clamped: a peak too low must show as MFU above 100%, flagged.
    over = throughput_metrics(1000, 1.0, 1e9, 5e11)
    assert over["mfu"] == pytest.approx(200.0) and over["mfu_above_100"] == 1.0


def test_mfu_above_100_is_flagged_in_jsonl_and_explained_once_on_the_console(tmp_path, caplog):
    metrics = MetricsLogger(str(tmp_path), Metrics(disable_color_printing=True), rank=0)
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        metrics.log(5, {"loss": 2.0, **throughput_metrics(1000, 1.0, 6e9, 2e12)})  # 300% of the peak
        metrics.log(10, {"loss": 1.9, **throughput_metrics(1000, 1.0, 6e9, 2e12)})
        metrics.log(15, {"loss": 1.8, **throughput_metrics(1000, 1.0, 6e9, 1e13)})  # 60%: plausible
    metrics.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "MFU 300% is impossible: the model achieved 6 TFLOP/s but the peak it is divided by is 2 TFLOP/s, so that "
        "peak is wrong (a measured CPU peak taken with a slower kernel or dtype than the model's linears run, or a "
        "datasheet entry for another device); MFU values are flagged mfu_above_100 in metrics.jsonl"
    ]
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [line.get("mfu_above_100") for line in lines] == [1.0, 1.0, None]
