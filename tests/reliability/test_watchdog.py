"""No hang (issue 14 part 2): the launcher's watchdog over per-rank heartbeat files, with real processes.

* a rank that goes silent (LYCHEE_FAULT=hang_after_step_2: alive, no progress) stops the 2-process stage after
  `training.launch.watchdog_s`, in one line, with where each rank was (its Python stack, via SIGUSR1);
* a rank that leaves early with exit code 0 while the other waits ends the stage within a bounded time, naming it;
* the watchdog's rules on heartbeat files of real live / dead processes: a rank hung after another exited, a
  process stuck in teardown after its work is done, a machine rank that never arrived.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import stage_plan

from lychee_pipeline.training.planning import run_training_stage
from lychee_pipeline.runtime import heartbeat
from lychee_pipeline.runtime.launcher import StageFailed
from lychee_pipeline.runtime.settings import LaunchParams
from lychee_pipeline.runtime.watchdog import Watchdog

STARTED = re.compile(r"\[rank (\d+)\] started: pid (\d+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _rank_pids(stage_dir: Path) -> dict[int, int]:
    return {int(r): int(p) for r, p in STARTED.findall((stage_dir / "launch.log").read_text())}


def test_a_silent_rank_stops_the_stage_and_says_where_each_rank_was(tmp_path, reliability_table, no_fault_env):
    plan = stage_plan(tmp_path, gpus=2, max_steps=6, launch={"watchdog_s": 6, "process_group_timeout_s": 300})
    no_fault_env.setenv("LYCHEE_FAULT", "hang_after_step_2")
    no_fault_env.setenv("LYCHEE_FAULT_RANK", "1")
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        run_training_stage(reliability_table, plan, devices=2, final=True)
    elapsed = time.monotonic() - started
    message = str(failed.value)
    first = message.splitlines()[0]
    # neither the 300 s collective timeout nor the 300 s wall clock: the 6 s watchdog
    assert "stopped by the watchdog: no progress for 6 s (training.launch.watchdog_s)" in first, message
    assert elapsed < 90, elapsed
    assert "rank 1 (last progress: step 2" in first and "rank 0 (last progress: step 2" in first
    # each rank's stack: rank 1 asleep in the fault point, rank 0 waiting in a collective in torch (DDP's
    # forward of the next step, called from the training step)
    assert re.search(r"rank 1 in lychee_pipeline/training/faults\.py:\d+ fault_point", first), first
    assert re.search(r"rank 0 in torch/\S+ \S+ \(from lychee_pipeline/training/step\.py:\d+ __call__\)", first), first
    assert "rank 0:" in message and "rank 1:" in message  # last words of each rank follow
    stage_dir = Path(plan.run_dir) / "stage_2cpu_final"
    pids = _rank_pids(stage_dir)
    assert len(pids) == 2 and not [p for p in pids.values() if _alive(p)]
    assert not (stage_dir / "RUNNING.lock").exists() and not (stage_dir / "result.json").exists()


def test_a_rank_that_leaves_early_ends_the_stage_naming_it(tmp_path, reliability_table, no_fault_env):
    plan = stage_plan(tmp_path, gpus=2, max_steps=6,
                      launch={"hang_after_exit_s": 5, "process_group_timeout_s": 300, "timeout_s": 300})
    no_fault_env.setenv("LYCHEE_FAULT", "exit_after_step_2")  # os._exit(0): torchrun sees a success
    no_fault_env.setenv("LYCHEE_FAULT_RANK", "1")
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        run_training_stage(reliability_table, plan, devices=2, final=True)
    elapsed = time.monotonic() - started
    message = str(failed.value)
    assert elapsed < 90 and "timed out" not in message, (elapsed, message)
    # Either gloo reports the lost peer to rank 0 at once (then the progress line says who left first), or rank 0
    # waits and the watchdog names it as hung after rank 1 exited.
    progress = next(line for line in message.splitlines() if line.startswith("Progress:"))
    assert ("rank 1 at step 2 (step" in progress and "exited first" in progress) or \
        "hung: rank 1 exited after step 2" in message, message
    stage_dir = Path(plan.run_dir) / "stage_2cpu_final"
    assert not [p for p in _rank_pids(stage_dir).values() if _alive(p)]


def test_a_rank_stuck_in_teardown_after_the_result_is_written_ends_the_stage_done(tmp_path, reliability_table,
                                                                                   no_fault_env, caplog):
    """The issue's hang: rank 0 wrote result.json and exited, rank 1 stayed asleep in gloo after the final barrier.
    Reproduced with LYCHEE_FAULT=hang_before_end_training on rank 1: the stage's work is done, so the launcher
    stops the stuck process after hang_after_exit_s and returns the result, with a warning naming the rank."""
    plan = stage_plan(tmp_path, gpus=2, max_steps=3, launch={"hang_after_exit_s": 5, "watchdog_s": 300,
                                                             "process_group_timeout_s": 300, "timeout_s": 300})
    no_fault_env.setenv("LYCHEE_FAULT", "hang_before_end_training")
    no_fault_env.setenv("LYCHEE_FAULT_RANK", "1")
    caplog.set_level("WARNING")
    started = time.monotonic()
    result = run_training_stage(reliability_table, plan, devices=2, final=True)
    elapsed = time.monotonic() - started
    assert result.steps == 3 and result.replica_max_diff == 0.0 and elapsed < 120, elapsed
    # rank 1 hangs after the barrier; rank 0 then waits for it in end_training (or, past it, at exit): both named
    assert "rank 1 (leaving)" in caplog.text and "passed the final barrier but did not exit within 5 s (stuck in " \
        "process-group teardown)" in caplog.text, caplog.text
    stage_dir = Path(plan.run_dir) / "stage_2cpu_final"
    assert not [p for p in _rank_pids(stage_dir).values() if _alive(p)]
    assert not (stage_dir / "RUNNING.lock").exists()


# --- the rules, on heartbeat files of real processes (no launch) ---------------------------------------------

@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _beat(stage_dir: Path, rank: int, pid: int, step: int, phase: str, age_s: float) -> None:
    folder = stage_dir / heartbeat.DIR_NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "pid": pid, "host": os.uname().nodename, "step": step, "phase": phase,
        "time": time.time() - age_s}))


LAUNCH = LaunchParams(watchdog_s=1800, hang_after_exit_s=3, rendezvous_timeout_s=900, num_machines=1, machine_rank=0)


def test_rule_a_rank_silent_after_another_exited_is_named_as_hung(tmp_path, sleeper, dead_pid):
    _beat(tmp_path, 0, dead_pid, 8, "done", age_s=1)
    _beat(tmp_path, 1, sleeper.pid, 8, "finishing", age_s=1)
    dog = Watchdog(tmp_path, LAUNCH, devices=2)
    assert dog.check() is None  # rank 0 just left: rank 1 gets hang_after_exit_s
    kind, reason = dog.check(now=time.time() + 4)
    assert kind == "hung" and reason.startswith("rank 1 (last progress: step 8, finishing"), reason
    assert "hung: rank 0 exited after step 8 (done)" in reason


def test_rule_work_done_but_a_process_stuck_in_teardown(tmp_path, sleeper, dead_pid):
    _beat(tmp_path, 0, dead_pid, 8, "done", age_s=1)
    _beat(tmp_path, 1, sleeper.pid, 8, "done", age_s=1)
    dog = Watchdog(tmp_path, LAUNCH, devices=2)
    assert dog.check() is None
    kind, reason = dog.check(now=time.time() + 4)
    assert kind == "teardown" and reason.startswith("rank 1 (done) passed the final barrier but did not exit within 3 s"), \
        reason


def test_rule_silence_names_the_stalest_rank(tmp_path, sleeper):
    _beat(tmp_path, 0, os.getpid(), 5, "step", age_s=20)
    _beat(tmp_path, 1, sleeper.pid, 4, "step", age_s=40)
    dog = Watchdog(tmp_path, LAUNCH.model_copy(update={"watchdog_s": 30}), devices=2)
    kind, reason = dog.check()
    assert kind == "silent" and reason == (
        "no progress for 30 s (training.launch.watchdog_s): rank 1 (last progress: step 4, step, 40 s ago)")


def test_rule_a_machine_rank_that_never_arrives_is_named(tmp_path):
    launch = LAUNCH.model_copy(update={"num_machines": 2, "machine_rank": 0, "main_process_ip": "127.0.0.1",
                                       "rendezvous_timeout_s": 10})
    dog = Watchdog(tmp_path, launch, devices=1, port=29555)
    assert dog.check() is None
    kind, reason = dog.check(now=time.time() + 11)
    assert kind == "rendezvous" and reason.startswith(
        "no rank of machine rank 0 got past the rendezvous at 127.0.0.1:29555 within 10 s: machine rank 1 of 2 "
        "never arrived"), reason


def test_rule_startup_gets_the_rendezvous_timeout_not_the_watchdog(tmp_path, sleeper):
    """Loading a large model takes a minute: before step 1 the limit is rendezvous_timeout_s (a 10 s watchdog stopped
    clean soak stages on a loaded machine while a rank was still importing)."""
    _beat(tmp_path, 0, sleeper.pid, 0, "started", age_s=40)
    dog = Watchdog(tmp_path, LAUNCH.model_copy(update={"watchdog_s": 10, "rendezvous_timeout_s": 60}), devices=1)
    assert dog.check() is None
    kind, reason = dog.check(now=time.time() + 61)
    assert kind == "silent" and "(no first step within training.launch.rendezvous_timeout_s)" in reason, reason


def test_rule_two_exits_seen_at_once_name_the_rank_that_stopped_beating_first(tmp_path):
    """On a loaded machine both ranks can be seen gone in the same poll (rank 1 left, rank 0 failed right after):
    the one whose heartbeats stopped first is named as having exited first; a tie of both names nobody."""
    pids = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        pids.append(proc.pid)
    _beat(tmp_path, 0, pids[0], 3, "step", age_s=1)
    _beat(tmp_path, 1, pids[1], 2, "step", age_s=4)  # rank 1 stopped beating three seconds earlier
    dog = Watchdog(tmp_path, LAUNCH, devices=2)
    dog.beats = heartbeat.read_heartbeats(tmp_path)
    dog.note_exits()  # one poll sees both gone
    assert dog.first_to_leave() == 1
    assert "rank 1 at step 2 (step, 4 s ago, exited first)" in dog.describe() and "rank 0 at step 3 (step, 1 s ago, " \
        "exited)" in dog.describe()
    _beat(tmp_path, 1, pids[1], 2, "step", age_s=1)  # both stopped beating at the same time: nobody is named
    dog.beats = heartbeat.read_heartbeats(tmp_path)
    assert dog.first_to_leave() is None and "exited first" not in dog.describe()
    _beat(tmp_path, 0, pids[0], 2, "failed", age_s=1)  # ... unless one of them ended on an exception
    dog.beats = heartbeat.read_heartbeats(tmp_path)
    assert dog.first_to_leave() == 1 and "rank 1 at step 2 (step, 1 s ago, exited first)" in dog.describe()


def test_a_rank_that_raises_beats_failed_at_its_last_step(tmp_path):
    """``Heartbeat.on_uncaught_exception``: a real process that ends on an exception leaves phase ``failed``."""
    script = (f"from lychee_pipeline.runtime.heartbeat import Heartbeat\n"
              f"beat = Heartbeat({str(tmp_path)!r}, 1)\nbeat(4, 'step')\nbeat.on_uncaught_exception()\n"
              "raise RuntimeError('peer vanished')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "peer vanished" in proc.stderr  # Python still prints the error
    record = heartbeat.read_heartbeats(tmp_path)[1]
    assert record["phase"] == "failed" and record["step"] == 4
