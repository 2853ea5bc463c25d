"""Ctrl-C stops the whole training stage (issue 14 part 1), with real processes: `kedro run` in a project copy.

* SIGINT to the `kedro` process while a 2-process stage trains: the launcher and both ranks (their own session,
  so a terminal's Ctrl-C never reaches them) are gone within 30 s, the MLflow stage run and the parent run are
  KILLED with a `failure_reason`, the stage lock is gone, and a re-run with `training.resume: true` resumes;
* a stage folder locked by a live process is refused in one line naming the PID; a stale lock is removed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from project_runs import make_project_copy

from lychee_pipeline.runtime import processes
from lychee_pipeline.runtime.processes import LOCK_NAME, StageBusy, check_stage_lock

STARTED = re.compile(r"\[rank (\d+)\] started: pid (\d+)")
STEP = re.compile(r"\[rank 0\] step (\d+)/")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes (its parent, PID 1 or us, reaps it)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _edit(path: Path, section: str, values: dict) -> None:
    conf = yaml.safe_load(path.read_text())
    conf[section] = _merge(conf[section], values)
    path.write_text(yaml.safe_dump(conf))


def _merge(base: dict, values: dict) -> dict:
    out = dict(base)
    for key, value in values.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _small_project(root: Path) -> Path:
    make_project_copy(root)
    base = root / "conf" / "base"
    _edit(base / "parameters_demo_data.yml", "demo_data", {"n_products": 40, "n_records": 200})
    _edit(base / "parameters_evaluation.yml", "evaluation", {"max_queries": 4, "significance": {"n_resamples": 200}})
    _edit(base / "parameters_training.yml", "model", {"finetune": "full"})
    _edit(base / "parameters_training.yml", "training", {
        "group_size": 4, "max_steps": 400, "checkpoint_every": 2, "keep_last": 2, "max_pixels": 12544,
        "learning_rate": 2e-3, "scheduler": "constant", "warmup_ratio": 0.0, "max_length": 512})
    _edit(base / "parameters_training.yml", "stages", {"check_steps": {1: 1, 2: 1}})
    return root


def _kedro(root: Path, params: str, log_name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ, KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
               CUDA_VISIBLE_DEVICES="")
    env.pop("LYCHEE_FAULT", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    out = root / log_name
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kedro", "run", "--pipeline", "full", "--params", params, *extra],
                                cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=_as_from_a_terminal)
    return proc, out


def _as_from_a_terminal() -> None:
    # a suite started in the background by a non-interactive shell (`make test &`) hands its children SIGINT
    # ignored, and Python then installs no Ctrl-C handler: kedro gets SIGINT's default, as from a terminal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, out: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"kedro exited ({proc.returncode}) before {what}:\n{out.read_text()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}:\n{out.read_text()[-3000:]}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_ctrl_c_on_kedro_stops_the_whole_stage_and_resume_works(tmp_path, signum):
    root = _small_project(tmp_path / "project")
    stage_dir = root / "data/06_models/runs/full/stage_2cpu_final"
    launch_log = stage_dir / "launch.log"
    proc, out = _kedro(root, "gpus=2,device=cpu", "kedro_1.log")
    # The resume after Ctrl-C below needs checkpoint-2 (checkpoint_every: 2); SIGTERM only needs the ranks training.
    steps_before_signal = 2 if signum == signal.SIGINT else 1

    def ranks_stepping():
        text = launch_log.read_text() if launch_log.is_file() else ""
        pids = {int(r): int(p) for r, p in STARTED.findall(text)}
        return pids if len(pids) == 2 and len(STEP.findall(text)) >= steps_before_signal else None

    pids = _wait_for(ranks_stepping, 150, "both ranks of stage_2cpu_final started and stepped", proc, out)
    pgid = os.getpgid(pids[0])
    assert pgid != os.getpgid(proc.pid)  # the stage runs in its own session: only the kedro process is signalled
    lock = json.loads((stage_dir / LOCK_NAME).read_text())
    assert lock["pid"] == proc.pid and lock["host"] == socket.gethostname()

    interrupted = time.monotonic()
    os.kill(proc.pid, signum)  # a terminal's Ctrl-C (or a SIGTERM), to kedro only
    while time.monotonic() - interrupted < 30 and (
            proc.poll() is None or _group_members(pgid) or any(_alive(p) for p in pids.values())):
        time.sleep(0.2)
    stopped_in = time.monotonic() - interrupted
    print(f"{signal.Signals(signum).name}: kedro and the stage's processes gone after {stopped_in:.1f} s")
    survivors = [p for p in pids.values() if _alive(p)] + _group_members(pgid)
    if proc.poll() is None:
        proc.kill()
    assert not survivors, f"processes of the stage survived Ctrl-C: {survivors}"
    assert proc.returncode is not None and proc.returncode != 0, "kedro did not exit on Ctrl-C"
    assert stopped_in < 30
    assert not (stage_dir / "result.json").exists() and not (stage_dir / LOCK_NAME).exists()
    time.sleep(1.0)  # nothing writes into the folder any more
    files = {p: p.stat().st_mtime for p in stage_dir.rglob("*") if p.is_file()}
    time.sleep(2.0)
    assert files == {p: p.stat().st_mtime for p in stage_dir.rglob("*") if p.is_file()}

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lychee_pipeline").experiment_id])
    by_stage = {r.data.tags.get("stage"): r for r in runs if "mlflow.parentRunId" in r.data.tags}
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert by_stage["stage_1cpu"].info.status == "FINISHED"
    assert by_stage["stage_2cpu_final"].info.status == "KILLED"
    name = signal.Signals(signum).name
    assert by_stage["stage_2cpu_final"].data.tags["failure_reason"].startswith(f"interrupted by {name}")
    assert [p.info.status for p in parents] == ["KILLED"]
    assert parents[0].data.tags["failure_reason"].startswith(f"interrupted by {name}")
    if signum == signal.SIGTERM:
        return  # the resume is the same after either signal

    # Re-run with resume (up to the final stage, to keep the test short): the stage continues from its newest
    # intact checkpoint, two steps further; the finished check stage is reused.
    last = max(int(p.name.split("-")[1]) for p in (stage_dir / "checkpoints").glob("checkpoint-*"))
    rerun, out2 = _kedro(root, f"gpus=2,device=cpu,training.resume=true,training.max_steps={last + 2}",
                         "kedro_2.log", "--to-nodes", "training.train_stage_final.gate_stage")
    assert rerun.wait(timeout=240) == 0, out2.read_text()[-3000:]
    log_text = launch_log.read_text()
    assert f"resumed from {stage_dir.relative_to(root)}/checkpoints/checkpoint-{last} at step {last}" in log_text
    result = json.loads((stage_dir / "result.json").read_text())
    assert result["steps"] == last + 2 and [s for s, _ in result["losses"]] == list(range(1, last + 3))
    assert not (stage_dir / LOCK_NAME).exists()


def test_a_live_lock_refuses_the_stage_folder_and_a_stale_one_is_removed(tmp_path, caplog):
    stage_dir = tmp_path / "stage_2cpu_final"
    stage_dir.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (stage_dir / LOCK_NAME).write_text(json.dumps(
            {"pid": owner.pid, "host": socket.gethostname(), "start": processes.process_start_time(owner.pid)}))
        with pytest.raises(StageBusy, match=rf"^stage folder {re.escape(str(stage_dir))} is in use by process "
                                            rf"{owner.pid} on "):
            check_stage_lock(stage_dir)
        assert (stage_dir / LOCK_NAME).exists()
    finally:
        owner.kill()
        owner.wait()
    caplog.set_level("INFO")
    check_stage_lock(stage_dir)  # the owner is gone: a stale lock
    assert not (stage_dir / LOCK_NAME).exists()
    assert f"removing stale lock {stage_dir / LOCK_NAME} (process {owner.pid}" in caplog.text


def test_the_training_node_refuses_a_locked_folder_before_deleting_it(tmp_path, reliability_table):
    from reliability_helpers import stage_plan

    from lychee_pipeline.training.planning import run_training_stage

    plan = stage_plan(tmp_path, gpus=1, max_steps=2)
    stage_dir = Path(plan.run_dir) / "stage_1cpu_final"
    stage_dir.mkdir(parents=True)
    (stage_dir / "keep.txt").write_text("written by the live run")
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (stage_dir / LOCK_NAME).write_text(json.dumps({"pid": owner.pid, "host": socket.gethostname()}))
        with pytest.raises(StageBusy, match=f"in use by process {owner.pid}"):
            run_training_stage(reliability_table, plan, devices=1, final=True)
    finally:
        owner.kill()
        owner.wait()
    assert (stage_dir / "keep.txt").exists()


def test_a_parameter_error_creates_no_mlflow_run(tmp_path):
    """Validated before kedro-mlflow opens its parent run (ParameterCheckHooks): one line, no empty FAILED run."""
    root = make_project_copy(tmp_path / "project")
    proc, out = _kedro(root, "device=cpu,training.learning_rate=-1", "kedro.log", "--nodes", "training.plan_training_stages")
    assert proc.wait(timeout=240) != 0
    text = out.read_text()
    flat = " ".join(text.split())  # rich wraps the console's lines
    # the one line on the terminal, the traceback (with the exception's type) in the log file (issue 32, item 4)
    assert "Error: invalid parameter training.learning_rate: Input should be greater than 0" in flat, text[-3000:]
    assert "ParameterError: invalid parameter training.learning_rate: Input should be greater than 0" in " ".join(
        (root / "info.log").read_text().split())
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lychee_pipeline")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    assert runs == [], [(r.info.run_id, r.info.status) for r in runs]
    assert "has started" not in text  # kedro-mlflow never started a run


def test_an_interrupted_scoring_launch_does_not_promise_a_resume(tmp_path, caplog):
    """Ctrl-C during the evaluation's multi-process scoring: its work folder is not resumed by
    `training.resume: true` (only training stages are), and the log says what is true instead."""
    import threading

    from lychee_pipeline.evaluation.score_shards import ScoringJobSpec
    from lychee_pipeline.evaluation.scoring import launch_scoring

    work = tmp_path / "scoring"
    spec = ScoringJobSpec(stage="scoring", output_dir=str(work), jobs=[])
    # Ctrl-C as the terminal sends it, once the launcher runs (its Python start alone takes seconds)
    timer = threading.Timer(1.5, signal.raise_signal, (signal.SIGINT,))
    caplog.set_level("WARNING", logger="lychee_pipeline.runtime.launcher")
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Python (see _as_from_a_terminal)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch_scoring(spec, 1, "cpu")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    assert f"stage scoring: stopped; its folder {work} is left as it is (launch.log says how far it got); the " \
           "next run starts this work again" in caplog.text, caplog.text
    assert "training.resume" not in caplog.text
    assert not (work / LOCK_NAME).exists()
