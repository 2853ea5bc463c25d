"""Per-rank heartbeat files, so the launcher can tell a stage that works from one that is done, dead or hung.

Each rank of a stage rewrites `<stage>/heartbeat/rank<N>.json` (atomically) at a few points: `started` (past the
rendezvous), after every optimizer step, `finishing` (before the final collectives) and `done` (after the
process group is destroyed, just before the process returns). The launcher (`launch.Watchdog`) reads them:

- a rank that made no progress for `training.launch.watchdog_s` stops the stage (one line naming the rank);
- a rank that has exited (or said `done`) while another alive rank makes no progress for
  `training.launch.hang_after_exit_s` stops the stage, naming the rank that hung;
- no local rank past the rendezvous within `training.launch.rendezvous_timeout_s` stops the stage, naming the
  machine ranks that did not arrive (multi-node).

The launcher's progress display (`progress.StageProgress`) reads them too: once a rank gives `total`, every
record carries it, with `unit` (what `step` counts: optimizer steps, scored pairs), `task` (a label within the
stage: the model a scoring launch scores) and `sharded` (true when each rank does its own share of `total`, as
the scoring shards do; false when every rank takes every step, as in data-parallel training).

Kept free of torch so the launcher imports it cheaply.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

DIR_NAME = "heartbeat"
STACK_SIGNAL = signal.SIGUSR1
STACK_HEADER = "(most recent call first):"


class Heartbeat:
    """`beat(step, phase[, total, task])` from a rank; never raises (a full disk must not stop training)."""

    def __init__(self, stage_dir: str | Path, rank: int, distributed_type: str = "", unit: str = "step",
                 sharded: bool = False):
        self.distributed_type = distributed_type  # what Accelerate really set up (DistributedType.FSDP, MULTI_CPU ...)
        self.path = Path(stage_dir) / DIR_NAME / f"rank{rank}.json"
        self.rank = rank
        self.unit, self.sharded = unit, sharded
        self.total: int | None = None  # given once (the first step's beat); repeated in every later record
        self.task: str | None = None
        self.step = 0  # of the last beat
        self.started = time.time()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        # SIGUSR1 prints this rank's Python stack (the launcher asks before it stops a silent stage).
        try:
            faulthandler.register(STACK_SIGNAL, file=sys.stdout, all_threads=False)
        except (AttributeError, ValueError, OSError):
            pass

    def __call__(self, step: int, phase: str, total: int | None = None, task: str | None = None) -> None:
        if total is not None:
            self.total = int(total)
        if task is not None:
            self.task = task
        self.step = step
        record = {"rank": self.rank, "pid": os.getpid(), "host": os.uname().nodename, "step": step, "phase": phase,
                  "time": time.time(), "distributed_type": self.distributed_type, "machine_rank": int(os.environ.get("GROUP_RANK", "0") or 0),
                  "total": self.total, "unit": self.unit, "task": self.task, "sharded": self.sharded}
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:
            pass


    def on_uncaught_exception(self) -> None:
        """Beat ``failed`` (at the last step) when the process ends on an exception, before Python prints it. The
        launcher can then tell a rank that raised (often because a peer vanished) from one that left without a
        word, when it sees both gone at once."""
        previous = sys.excepthook

        def hook(kind, value, traceback) -> None:
            self(self.step, "failed")
            previous(kind, value, traceback)

        sys.excepthook = hook


def read_heartbeats(stage_dir: str | Path) -> dict[int, dict]:
    """{rank: last record} of the ranks that have written one."""
    beats = {}
    folder = Path(stage_dir) / DIR_NAME
    if not folder.is_dir():
        return beats
    for path in folder.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
            beats[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced right now; the next look sees it
    return beats


def clear(stage_dir: str | Path) -> None:
    folder = Path(stage_dir) / DIR_NAME
    if folder.is_dir():
        for path in folder.iterdir():
            path.unlink(missing_ok=True)
