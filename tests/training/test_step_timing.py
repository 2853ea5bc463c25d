"""StepTiming: per-step attribution of a training loop's time without a host synchronisation per step (CPU)."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from lychee_pipeline.training.step_timing import StepTiming, summarize


def slow_loader(n: int, wait_s: float):
    for i in range(n):
        time.sleep(wait_s)  # a data loader the loop has to wait for
        yield {"x": torch.full((4,), float(i))}


def test_data_wait_issue_and_host_time_are_attributed_per_optimizer_step():
    """6 micro-batches, accumulation 2: 3 optimizer steps; each fetch waits 20 ms, each micro-batch works 10 ms."""
    timing = StepTiming(torch.device("cpu"))
    step = 0
    for i, _ in enumerate(timing.batches(slow_loader(6, 0.02))):
        time.sleep(0.01)
        if i % 2 == 0:
            timing.micro_batch_issued()
            continue
        step += 1
        timing.step_issued(step)
        time.sleep(0.005)  # the loop's tail (logging, heartbeat)
    timing.close()
    rows = timing.per_step()
    assert [r[0] for r in rows] == [1, 2, 3]
    for _, data_ms, issue_ms, host_ms, gpu_ms, gap_ms in rows:
        assert 40 <= data_ms < 40 + 30 and 20 <= issue_ms < 20 + 30  # two fetches, two micro-batches
        assert gpu_ms is None and gap_ms is None  # no CUDA events on a CPU
        assert host_ms >= data_ms + issue_ms
    window = timing.summary(2, pairs_per_step=8)
    assert window["steps"] == 2 and window["first_step"] == 2
    assert window["tail_ms"] == pytest.approx(window["step_wall_ms"] - window["data_wait_ms"] - window["issue_ms"])
    assert 3 <= window["tail_ms"] < 30  # the 5 ms tail of the step before
    assert 0.5 < window["host_blocked_on_data_share"] < 0.8  # 40 of ~65 ms
    assert window["pairs_per_s"] == pytest.approx(8 / (window["step_wall_ms"] / 1e3))
    assert timing._on_gc not in gc.callbacks  # closed: no callback left behind


def test_garbage_collections_inside_the_window_are_counted():
    timing = StepTiming(torch.device("cpu"))
    for step, _ in enumerate(timing.batches(range(3)), start=1):
        if step == 3:
            gc.collect()
        timing.step_issued(step)
    timing.close()
    out = timing.summary(2)
    assert out["gc_collections"] >= 1 and out["gc_ms_total"] > 0
    assert "allocator" not in out  # CUDA only


def test_summarize_reads_a_result_json_window_and_prefers_the_device_clock():
    rows = [[1, 5.0, 100.0, 120.0, None, None], [2, 1.0, 80.0, 100.0, 90.0, 10.0], [3, 3.0, 80.0, 110.0, 95.0, 15.0]]
    out = summarize(rows, 2, pairs_per_step=10)
    assert out["steps"] == 2 and out["data_wait_ms"] == 2.0 and out["step_wall_ms"] == 105.0
    assert out["device_step_wall_ms"] == 105.0 and out["gpu_busy_share"] == pytest.approx(92.5 / 105)
    assert out["pairs_per_s"] == pytest.approx(10 / 0.105)
    assert summarize(rows, 4) == {"steps": 0}
