import mmap

import torch

from torchtitan.tools.memory import MemoryMonitor


def test_cpu_reports_process_rss():
    monitor = MemoryMonitor(torch.device("cpu"))
    before = monitor.get_peak_stats()
    assert set(before) <= {"memory/peak_rss_gib", "memory/current_rss_gib"}
    assert before["memory/peak_rss_gib"] > 0.01  # a Python process with torch holds far more than 10 MiB
    if "memory/current_rss_gib" in before:
        assert 0 < before["memory/current_rss_gib"] <= before["memory/peak_rss_gib"] + 1e-3

    # Fresh anonymous pages, touched: an allocator could hand back memory an earlier test left resident.
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    block.write(b"\1" * len(block))
    after = monitor.get_peak_stats()
    assert after["memory/peak_rss_gib"] >= before["memory/peak_rss_gib"]
    if "memory/current_rss_gib" in after:
        assert after["memory/current_rss_gib"] > before["memory/current_rss_gib"] + 0.03
    block.close()
    monitor.reset_peak_stats()
    assert "RSS" in monitor.describe()
