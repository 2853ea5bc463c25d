"""Multi-node on loopback (issue 14 part 4): two launchers on this machine, machine ranks 0 and 1 over 127.0.0.1,
one CPU process each (gloo), train one stage together; a machine rank that never arrives fails the stage in
`training.launch.rendezvous_timeout_s`, naming it.

Each "machine" has its own stage folder (as separate hosts would); rank 0 of machine 0 writes the result.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from reliability_helpers import stage_plan

from lychee_pipeline.training.gate import check_stage
from lychee_pipeline.training.planning import run_training_stage
from lychee_pipeline.runtime.launcher import StageFailed, free_port

STARTED = re.compile(r"\[rank (\d+)\] started: pid (\d+)")


def _machine_plan(tmp_path: Path, machine_rank: int, port: int, **launch):
    launch = {"num_machines": 2, "machine_rank": machine_rank, "main_process_ip": "127.0.0.1",
              "main_process_port": port, "timeout_s": 300, "rendezvous_timeout_s": 180, **launch}
    return stage_plan(tmp_path / f"machine{machine_rank}", gpus=1, max_steps=4, learning_rate=1e-3,
                      scheduler="linear", warmup_ratio=0.25, launch=launch)


def test_two_machines_on_loopback_train_one_stage(tmp_path, reliability_table, no_fault_env):
    port = free_port()
    plans = [_machine_plan(tmp_path, m, port) for m in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_training_stage, reliability_table, plan, 1, True) for plan in plans]
        main, other = [f.result(timeout=400) for f in futures]
    # one stage of 2 processes: machine 0's rank 0 wrote the result, with both replicas equal
    assert main.devices == 2 and main.steps == 4 and main.replica_max_diff == 0.0
    assert check_stage(main, plans[0].stages.gate) is main  # the gate: finite, falling loss, schedule, replicas
    assert [s for s, _ in main.learning_rates] == [1, 2, 3, 4]  # one schedule step per optimizer step
    assert main.learning_rates[-1][1] == pytest.approx(0.0, abs=1e-12)  # linear decay ends at 0
    assert other.model_dump() == {**other.model_dump(), "machine_rank": 1, "num_machines": 2, "result_on_machine_rank_0": True}
    dirs = [Path(p.run_dir) / "stage_1cpu_final" for p in plans]
    assert (dirs[0] / "result.json").is_file() and not (dirs[1] / "result.json").exists()  # written once
    # each launcher ran one local process: global rank 0 on machine 0, global rank 1 on machine 1
    assert [r for r, _ in STARTED.findall((dirs[0] / "launch.log").read_text())] == ["0"]
    assert [r for r, _ in STARTED.findall((dirs[1] / "launch.log").read_text())] == ["1"]


def test_a_machine_that_never_arrives_is_named(tmp_path, reliability_table, no_fault_env):
    plan = _machine_plan(tmp_path, 0, free_port(), rendezvous_timeout_s=15)
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        run_training_stage(reliability_table, plan, 1, True)
    elapsed = time.monotonic() - started
    first = str(failed.value).splitlines()[0]
    assert "stopped by the watchdog: no rank of machine rank 0 got past the rendezvous at 127.0.0.1:" in first
    assert "within 15 s: machine rank 1 of 2 never arrived" in first, first
    assert elapsed < 60, elapsed
    lock = Path(plan.run_dir) / "stage_1cpu_final" / "RUNNING.lock"
    assert not lock.exists()


def test_machine_rank_must_be_below_num_machines(tmp_path):
    with pytest.raises(ValueError, match="invalid parameter training.launch.machine_rank: 2 must be below "
                                         "training.launch.num_machines 2"):
        _machine_plan(tmp_path, 2, 29500)
