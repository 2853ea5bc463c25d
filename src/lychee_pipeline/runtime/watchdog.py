"""The launcher's watchdog: reads the ranks' heartbeat files (runtime/heartbeat.py) and says when a launch must
be stopped, and why, in one line."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

from lychee_pipeline.runtime import heartbeat
from lychee_pipeline.runtime.processes import pid_alive
from lychee_pipeline.runtime.settings import LaunchParams


class Watchdog:
    """Reads the ranks' heartbeat files (runtime/heartbeat.py) and says when a stage must be stopped.

    `check()` returns None while the stage is healthy, else (kind, one-line reason): `hung` (a rank exited or
    said done while another alive one made no progress for `hang_after_exit_s`), `silent` (an alive rank made
    no progress for `watchdog_s`), `rendezvous` (no rank of this machine got past the rendezvous in
    `rendezvous_timeout_s`) or `teardown` (every rank said done, result written, one process did not exit).
    """

    def __init__(self, stage_dir: Path, launch: LaunchParams, devices: int, port: int | None = None):
        self.stage_dir, self.launch, self.devices, self.port = Path(stage_dir), launch, devices, port
        self.started = time.time()
        self.left_at: dict[int, float] = {}  # rank -> when we first saw it exited or done
        self.host = socket.gethostname()
        self.beats: dict[int, dict] = {}
        self.exited_at: dict[int, float] = {}  # rank -> when its process was first seen gone (polled often)

    def note_exits(self) -> None:
        """Cheap (no file reads): remember when each known rank's process went away, to tell who left first."""
        now = time.time()
        for rank, b in self.beats.items():
            if rank not in self.exited_at and not self._alive(b):
                self.exited_at[rank] = now

    def ask_for_stacks(self) -> bool:
        """SIGUSR1 to every alive rank of this machine: each prints its Python stack (faulthandler)."""
        asked = False
        for b in self.beats.values():
            if b.get("host") in (self.host, os.uname().nodename) and pid_alive(int(b["pid"])):
                with contextlib.suppress(OSError):
                    os.kill(int(b["pid"]), heartbeat.STACK_SIGNAL)
                    asked = True
        return asked

    def _alive(self, record: dict) -> bool:
        return record.get("host") not in (None, self.host, os.uname().nodename) or pid_alive(int(record["pid"]))

    def first_to_leave(self) -> int | None:
        """The rank that went away first, of two or more, or None when that cannot be told. Exits seen at once
        (within 0.1 s; the ranks of a failing stage often go together) are told apart by the ranks' last
        heartbeats: a rank that ended on an exception (phase ``failed``, often because a peer vanished) did not
        leave first if another left without one; else the rank that stopped beating first left first."""
        if len(self.beats) < 2 or not self.exited_at:
            return None
        earliest = min(self.exited_at.values())
        tied = [rank for rank, seen in self.exited_at.items() if seen - earliest <= 0.1]
        if len(tied) == 1:
            return tied[0]
        without_error = [rank for rank in tied if self.beats.get(rank, {}).get("phase") != "failed"]
        if len(without_error) == 1:
            return without_error[0]
        last_beats = sorted((self.beats[rank]["time"], rank) for rank in tied if rank in self.beats)
        if len(last_beats) == len(tied) and last_beats[0][0] < last_beats[1][0] - 0.1:
            return last_beats[0][1]
        return None

    def describe(self, now: float | None = None) -> str:
        """`rank 0 step 3 (step, 2 s ago, exited); rank 1 ...` from the last heartbeats read."""
        now = now or time.time()
        self.beats = heartbeat.read_heartbeats(self.stage_dir) or self.beats
        parts = []
        first = self.first_to_leave()
        for rank, b in sorted(self.beats.items()):
            state = "exited first" if rank == first else "alive" if self._alive(b) else "exited"
            parts.append(f"rank {rank} at step {b['step']} ({b['phase']}, {now - b['time']:.0f} s ago, {state})")
        return "; ".join(parts) if parts else "no rank reported progress"

    def check(self, now: float | None = None) -> tuple[str, str] | None:
        now = now or time.time()
        beats = heartbeat.read_heartbeats(self.stage_dir)
        if beats:
            self.beats = beats
        beats = self.beats
        launch = self.launch
        if not beats:
            limit = launch.rendezvous_timeout_s
            if now - self.started <= limit:
                return None
            machines, me = launch.num_machines, launch.machine_rank
            where = f"{launch.main_process_ip or '127.0.0.1'}:{self.port or launch.main_process_port}"
            if machines > 1:
                missing = [m for m in range(machines) if m != me]
                return "rendezvous", (
                    f"no rank of machine rank {me} got past the rendezvous at {where} within {limit} s: machine "
                    f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {machines} never "
                    "arrived (start the same command there with its training.launch.machine_rank)")
            return "rendezvous", f"no rank got past the process-group rendezvous at {where} within {limit} s"
        alive = {rank: self._alive(b) for rank, b in beats.items()}
        for rank, b in beats.items():
            if (not alive[rank] or b["phase"] == "done") and rank not in self.left_at:
                self.left_at[rank] = now
        if self.left_at:
            limit = launch.hang_after_exit_s
            first = min(self.left_at, key=self.left_at.get)
            stuck = [r for r, b in beats.items() if alive[r] and now - max(b["time"], self.left_at[first]) > limit
                     and (r not in self.left_at or now - self.left_at[r] > limit)]
            if stuck:
                gone = beats[first]
                how = "exited" if not alive[first] else "said done"
                past_barrier = ("leaving", "done")
                if all(b["phase"] in past_barrier for b in beats.values()):
                    names = ", ".join(f"rank {r} ({beats[r]['phase']})" for r in sorted(stuck))
                    return "teardown", (f"{names} passed the final barrier but did not exit within {limit} s (stuck in "
                                        "process-group teardown); stopped")
                names = ", ".join(f"rank {r} (last progress: step {beats[r]['step']}, {beats[r]['phase']}, "
                                  f"{now - beats[r]['time']:.0f} s ago)" for r in stuck)
                return "hung", (f"{names} hung: rank {first} {how} after step {gone['step']} ({gone['phase']}) "
                                f"{now - self.left_at[first]:.0f} s ago and the rest made no progress for {limit} s "
                                "(training.launch.hang_after_exit_s)")
        # From the first step on, watchdog_s; before it (loading the model, the first step's warm-up), the
        # startup gets rendezvous_timeout_s counted from the launch, as a 16 GB model takes a minute to load.
        limit = launch.watchdog_s
        startup = max(limit, launch.rendezvous_timeout_s)

        def over(b: dict) -> bool:
            return now - b["time"] > limit if b["phase"] != "started" else now - self.started > startup

        silent = sorted((r for r, b in beats.items() if alive[r] and r not in self.left_at and over(b)),
                        key=lambda r: beats[r]["time"])
        if silent:
            names = ", ".join(f"rank {r} (last progress: step {beats[r]['step']}, {beats[r]['phase']}, "
                              f"{now - beats[r]['time']:.0f} s ago)" for r in silent)
            which = ("training.launch.watchdog_s" if any(beats[r]["phase"] != "started" for r in silent)
                     else "no first step within training.launch.rendezvous_timeout_s")
            return "silent", f"no progress for {limit if which.startswith('training') else startup} s ({which}): {names}"
        return None
