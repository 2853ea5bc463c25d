"""Where a training step's wall time goes, measured without a host synchronisation per step.

The training loop (``train.py``) and the isolated step of ``benchmarks/train_stage.py`` use the same
:class:`StepTiming`, so their figures compare directly. Per optimizer step it keeps:

- ``data_ms``: host time blocked in ``next()`` on the data loader (all micro-batches of the step);
- ``issue_ms``: host time from a batch in hand to the step's work handed to the device (forward, backward,
  clipping, optimizer step, zero_grad); on a GPU that is launch time plus any sync inside the model;
- ``host_ms``: host time from the previous step's end of issue to this one's (data + issue + the loop's tail:
  read-back and logging on logging steps, checkpoints, heartbeat);
- on CUDA, from two events per step, read back only when they have completed (``collect`` polls, never
  waits): ``gpu_ms``, the device's span of the step's work, and ``gap_ms``, the device's time between the
  previous step's end and this step's start (host→device copies and idle waiting for the host).
  ``gap_ms + gpu_ms`` is the step's wall time on the device's own clock, exact over any window of steps.

The summary adds the window's Python garbage-collection time and (CUDA) the caching allocator's new device
allocations (``cudaMalloc``), the two host-side costs a long loop has and a short benchmark may not show.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import torch

ROW_FIELDS = ("step", "data_ms", "issue_ms", "host_ms", "gpu_ms", "gap_ms")


class StepTiming:
    """Cheap per-step attribution: host clocks always, CUDA events on a GPU (never waited on per step)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock  # seconds on the host; a test passes its own to count exactly what goes where
        self.cuda = device.type == "cuda"
        self.device = device
        self.rows: dict[int, list] = {}  # step -> [data_ms, issue_ms, host_ms, gpu_ms, gap_ms]
        self._data_s = 0.0  # of the step being assembled
        self._issue_s = 0.0
        self._arrived: float | None = None
        self._last_issued: float | None = None
        self._issued_at: dict[int, float] = {}  # step -> host clock at its end of issue
        self._start_event = None
        self._prev_end = None
        self._events: list[tuple[int, object, object, object]] = []  # (step, prev_end, start, end) not yet read
        self.readback_s, self.readbacks = 0.0, 0
        self.heartbeat_s = 0.0
        self._gc_started: float | None = None
        self.gc_events: list[tuple[float, float]] = []  # (host time at the end, seconds)
        self._alloc_at: dict[int, dict] = {}
        gc.callbacks.append(self._on_gc)

    # -- the loop's hooks ---------------------------------------------------------------------------------

    def batches(self, loader: Iterable) -> Iterator:
        """Iterate ``loader``, timing each ``next()`` as data wait; the step's start event follows the batch."""
        iterator = iter(loader)
        while True:
            began = self.clock()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            now = self.clock()
            self._data_s += now - began
            self._arrived = now
            if self._last_issued is None:  # the first step of this loop: its host time starts at its first fetch
                self._last_issued = began
            if self.cuda and self._start_event is None:
                self._start_event = torch.cuda.Event(enable_timing=True)
                self._start_event.record()
            yield batch

    def micro_batch_issued(self) -> None:
        """A micro-batch's forward/backward handed to the device (an accumulation step without an update)."""
        if self._arrived is not None:
            self._issue_s += self.clock() - self._arrived
            self._arrived = None

    def step_issued(self, step: int) -> None:
        """Optimizer step ``step`` handed to the device: closes its host figures and records its end event."""
        self.micro_batch_issued()
        now = self.clock()
        host = now - self._last_issued if self._last_issued is not None else float("nan")
        self.rows[step] = [1e3 * self._data_s, 1e3 * self._issue_s, 1e3 * host, None, None]
        self._last_issued = self._issued_at[step] = now
        self._data_s = self._issue_s = 0.0
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((step, self._prev_end, self._start_event, end))
            self._prev_end, self._start_event = end, None

    def add_readback(self, seconds: float) -> None:
        self.readback_s += seconds
        self.readbacks += 1

    def add_heartbeat(self, seconds: float) -> None:
        self.heartbeat_s += seconds

    @contextlib.contextmanager
    def heartbeat(self) -> Iterator[None]:
        """Times the loop's heartbeat write (part of the step's tail) into ``heartbeat_ms_total``."""
        began = self.clock()
        yield
        self.add_heartbeat(self.clock() - began)

    def mark_allocator(self, step: int) -> None:
        """Snapshot of the CUDA caching allocator's counters (host-side, no sync) after ``step``."""
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            self._alloc_at[step] = {k: int(stats.get(k, 0)) for k in
                                    ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}

    def collect(self, wait: bool = False) -> None:
        """Read the elapsed times of the steps whose events have completed (``wait``: all of them, at the end)."""
        while self._events:
            step, prev_end, start, end = self._events[0]
            if not wait and not end.query():
                break  # still queued on the device: read at a later call, never waited for
            end.synchronize()
            row = self.rows[step]
            row[3] = start.elapsed_time(end) if start is not None else None
            row[4] = prev_end.elapsed_time(start) if prev_end is not None and start is not None else None
            self._events.pop(0)

    def close(self) -> None:
        self.collect(wait=True)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = self.clock()
        elif self._gc_started is not None:
            now = self.clock()
            self.gc_events.append((now, now - self._gc_started))
            self._gc_started = None

    # -- results --------------------------------------------------------------------------------------------

    def per_step(self) -> list[list]:
        """``[step, data_ms, issue_ms, host_ms, gpu_ms, gap_ms]`` per optimizer step (gpu/gap null off CUDA)."""
        return [[step, *(None if v is None else round(v, 3) for v in row)] for step, row in sorted(self.rows.items())]

    def summary(self, first_step: int, last_step: int | None = None, pairs_per_step: int | None = None) -> dict:
        """Means over the optimizer steps ``first_step..last_step`` (all recorded ones by default)."""
        return summarize(self.per_step(), first_step, last_step, pairs_per_step) | self._extras(first_step)

    def _extras(self, first_step: int) -> dict:
        out = {"per_step_fields": list(ROW_FIELDS), "readbacks": self.readbacks,
               "readback_ms_mean": 1e3 * self.readback_s / self.readbacks if self.readbacks else 0.0,
               "heartbeat_ms_total": 1e3 * self.heartbeat_s}
        window_start = self._issued_at.get(first_step - 1)  # host clock at the window's start
        collected = [s for t, s in self.gc_events if window_start is None or t >= window_start]
        out["gc_collections"] = len(collected)
        out["gc_ms_total"] = 1e3 * sum(collected)
        if self._alloc_at:
            marks = sorted(self._alloc_at)
            base = next((s for s in marks if s >= first_step - 1), marks[0])
            last = marks[-1]
            out["allocator"] = {"from_step": base, "to_step": last,
                                **{k.removeprefix("num_"): self._alloc_at[last][k] - self._alloc_at[base][k]
                                   for k in self._alloc_at[last]}}
        return out


def summarize(rows: list[list], first_step: int, last_step: int | None = None,
              pairs_per_step: int | None = None) -> dict:
    """Window means of :meth:`StepTiming.per_step` rows; also usable on a stage's result JSON."""
    window = [r for r in rows if r[0] >= first_step and (last_step is None or r[0] <= last_step)]
    if not window:
        return {"steps": 0}

    def mean(values):
        values = [v for v in values if v is not None and not math.isnan(v)]
        return statistics.fmean(values) if values else None

    data, issue, host = (mean(r[i] for r in window) for i in (1, 2, 3))
    gpu, gap = mean(r[4] for r in window), mean(r[5] for r in window)
    out = {"first_step": window[0][0], "last_step": window[-1][0], "steps": len(window),
           "step_wall_ms": host, "data_wait_ms": data, "issue_ms": issue,
           "tail_ms": (host - data - issue) if None not in (host, data, issue) else None,
           "host_blocked_on_data_share": (data / host) if data is not None and host else None}
    if gpu is not None and gap is not None:
        # on the device's clock: exact over the window whatever the host's lead
        device_wall = gpu + gap
        out |= {"gpu_step_ms": gpu, "gpu_gap_ms": gap, "device_step_wall_ms": device_wall,
                "gpu_busy_share": gpu / device_wall if device_wall else None}
        wall = device_wall
    else:
        wall = host
    if pairs_per_step and wall:
        out["pairs_per_s"] = pairs_per_step / (wall / 1e3)
    return out
