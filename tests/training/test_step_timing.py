"""StepTiming: per-step attribution of a training loop's time without a host synchronisation per step (CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from lychee_pipeline.training.step_timing import StepTiming, summarize


class CountingClock:
    """The host clock StepTiming reads, moved only by the test: every millisecond is put where the test says."""

    def __init__(self):
        self.ms = 0

    def __call__(self) -> float:
        return self.ms / 1e3

    def spend(self, ms: int) -> None:
        self.ms += ms


def waiting_loader(clock: CountingClock, waits_ms: list[int]):
    for i, wait in enumerate(waits_ms):
        clock.spend(wait)  # inside next(): the data loader the loop has to wait for
        yield {"x": torch.full((4,), float(i))}


def test_data_wait_issue_and_host_time_are_attributed_per_optimizer_step():
    """6 micro-batches, accumulation 2: 3 optimizer steps. Fetch i waits 10 * (i + 1) ms (a different amount for
    every micro-batch, so a wait counted under the wrong step shows), micro-batch i works 1 + i ms, and each
    optimizer step has a 5 ms tail (logging, heartbeat) that belongs to the next step's host time."""
    clock = CountingClock()
    timing = StepTiming(torch.device("cpu"), clock=clock)
    waits, work = [10, 20, 30, 40, 50, 60], [1, 2, 3, 4, 5, 6]
    step = 0
    for i, _ in enumerate(timing.batches(waiting_loader(clock, waits))):
        clock.spend(work[i])
        if i % 2 == 0:
            timing.micro_batch_issued()
            continue
        step += 1
        timing.step_issued(step)
        clock.spend(5)  # the loop's tail
    timing.close()
    rows = timing.per_step()
    assert [r[0] for r in rows] == [1, 2, 3]
    # step k: micro-batches 2k-2 and 2k-1; its host time runs from the previous step's end of issue (step 1:
    # from its first fetch) and so holds the previous step's tail
    expected = [[1, 10 + 20, 1 + 2, 10 + 1 + 20 + 2],
                [2, 30 + 40, 3 + 4, 5 + 30 + 3 + 40 + 4],
                [3, 50 + 60, 5 + 6, 5 + 50 + 5 + 60 + 6]]
    for (step, data_ms, issue_ms, host_ms, gpu_ms, gap_ms), (want_step, want_data, want_issue, want_host) in zip(
            rows, expected):
        assert (step, data_ms, issue_ms, host_ms) == (want_step, want_data, want_issue, want_host)
        assert gpu_ms is None and gap_ms is None  # no CUDA events on a CPU
    window = timing.summary(2, pairs_per_step=8)
    assert window["steps"] == 2 and window["first_step"] == 2 and window["last_step"] == 3
    assert window["data_wait_ms"] == pytest.approx((70 + 110) / 2) and window["issue_ms"] == pytest.approx(9)
    assert window["step_wall_ms"] == pytest.approx((82 + 126) / 2)
    assert window["tail_ms"] == pytest.approx(5)  # the 5 ms tail of the step before, nothing else
    assert window["host_blocked_on_data_share"] == pytest.approx(90 / 104)
    assert window["pairs_per_s"] == pytest.approx(8 / 0.104)
    assert timing._on_gc not in gc.callbacks  # closed: no callback left behind


def test_the_heartbeat_and_read_backs_are_counted_apart_from_the_steps():
    clock = CountingClock()
    timing = StepTiming(torch.device("cpu"), clock=clock)
    for step, _ in enumerate(timing.batches(waiting_loader(clock, [1, 1, 1])), start=1):
        timing.step_issued(step)
        with timing.heartbeat():
            clock.spend(3)
        timing.add_readback(0.002)
    timing.close()
    out = timing.summary(2)
    assert out["heartbeat_ms_total"] == pytest.approx(9) and out["readbacks"] == 3
    assert out["readback_ms_mean"] == pytest.approx(2)


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
