"""Soak: N short real 2-process CPU stages in a row, some interrupted or faulted at random; report hangs and orphans.

Each stage runs `training.planning.run_training_stage` (what the stage node runs: `accelerate launch` -> 2 gloo ranks, builtin:tiny)
in a driver subprocess. A scenario is drawn per stage (seeded):

  clean          no fault: must finish (result.json, all steps)
  sigint/sigterm the signal to the driver once rank 0 logged a step: must end interrupted
  kill_rank      LYCHEE_FAULT=after_step_<k> on a random rank (SIGKILL): must fail (StageFailed)
  hang_rank      LYCHEE_FAULT=hang_after_step_<k> (alive, silent): the watchdog must stop it (StageFailed)
  exit_rank      LYCHEE_FAULT=exit_after_step_<k> (exit code 0 mid-run): must fail, not hang

After each driver exits (or is declared HUNG after --hang-after-s), every process carrying this stage's
LYCHEE_SOAK_TAG in its environment is an orphan. A stage ends in a known state when its outcome is the one
expected for its scenario, it left no orphan and no RUNNING.lock. Prints a table and writes JSON.

    PYTHONPATH=src python benchmarks/stage_soak.py --n 20 --out benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

SCENARIOS = ["clean", "clean", "sigint", "sigterm", "kill_rank", "hang_rank", "exit_rank"]
EXPECTED = {"clean": "done", "sigint": "interrupted", "sigterm": "interrupted", "kill_rank": "failed",
            "hang_rank": "failed", "exit_rank": "failed"}


def driver(args: argparse.Namespace) -> int:
    """One stage in this process; its outcome as JSON in --outcome."""
    from lychee_pipeline.training.planning import plan_training, run_training_stage
    from lychee_pipeline.runtime.launcher import StageFailed
    from lychee_pipeline.runtime.processes import sigterm_raises

    # A process started in the background by a non-interactive shell inherits SIGINT ignored; Ctrl-C must work.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    job = json.loads(Path(args.job).read_text())
    plan = plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 4}}, job["training"], {}, 2, "cpu",
                         {"name": "soak", "output_root": job["root"]})
    outcome: dict = {"pid": os.getpid()}
    started = time.monotonic()
    try:
        with sigterm_raises():
            result = run_training_stage(job["data"], plan, devices=2, final=True)
        outcome.update(state="done", steps=result.steps, pairs_per_s=result.pairs_per_s)
    except KeyboardInterrupt as exc:
        outcome.update(state="interrupted", message=str(exc) or "KeyboardInterrupt")
    except StageFailed as exc:
        outcome.update(state="failed", message=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - an unknown state, reported as such
        outcome.update(state="error", message=f"{type(exc).__name__}: {exc}")
    outcome["driver_s"] = time.monotonic() - started
    Path(args.outcome).write_text(json.dumps(outcome))
    return 0


def tagged_processes(tag: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment carries LYCHEE_SOAK_TAG=tag."""
    needle = f"LYCHEE_SOAK_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def run_one(i: int, scenario: str, rng: random.Random, work: Path, data: str, args) -> dict:
    tag = f"{uuid.uuid4().hex[:12]}-{i}"
    root = work / f"stage{i:03d}"
    steps = args.steps
    training = dict(group_size=4, learning_rate=1e-3, warmup_ratio=0.0, scheduler="constant", max_steps=steps,
                    max_length=256, max_pixels=12544, checkpoint_every=2, keep_last=2, seed=i,
                    launch={"timeout_s": 600, "process_group_timeout_s": 60, "watchdog_s": args.watchdog_s,
                            "hang_after_exit_s": args.hang_after_exit_s})
    job = root / "job.json"
    root.mkdir(parents=True)
    job.write_text(json.dumps({"root": str(root), "data": data, "training": training}))
    env = dict(os.environ, LYCHEE_SOAK_TAG=tag, KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1",
               DO_NOT_TRACK="1")
    for name in ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    k = rng.randint(1, max(1, steps - 4))
    fault_rank = rng.randint(0, 1)
    if scenario in ("kill_rank", "hang_rank", "exit_rank"):
        env["LYCHEE_FAULT"] = {"kill_rank": "", "hang_rank": "hang_", "exit_rank": "exit_"}[scenario] + f"after_step_{k}"
        env["LYCHEE_FAULT_RANK"] = str(fault_rank)
    outcome_path = root / "outcome.json"
    log_path = root / "driver.log"
    started = time.monotonic()
    with open(log_path, "w") as sink:
        proc = subprocess.Popen([sys.executable, __file__, "--driver", "--job", str(job), "--outcome", str(outcome_path)],
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
    signal_at = None
    launch_log = root / "soak" / "stage_2cpu_final" / "launch.log"
    hung = False
    finished_before_signal = False
    while proc.poll() is None:
        now = time.monotonic()
        if now - started > args.hang_after_s:
            hung = True
            break
        if scenario in ("sigint", "sigterm") and signal_at is None:
            text = launch_log.read_text(errors="replace") if launch_log.is_file() else ""
            if f"step {k}/" in text or "done:" in text:
                time.sleep(rng.uniform(0.0, 0.3))
                finished_before_signal = "done:" in (launch_log.read_text(errors="replace"))
                proc.send_signal(signal.SIGINT if scenario == "sigint" else signal.SIGTERM)
                signal_at = time.monotonic()
        time.sleep(0.1)
    if hung:  # report, then clean up what this stage left so the next one starts fresh
        orphans = tagged_processes(tag)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    ended = time.monotonic()
    time.sleep(0.5)  # a process reparented to init needs a moment to be reaped
    orphans = [] if hung else tagged_processes(tag)
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    outcome = json.loads(outcome_path.read_text()) if outcome_path.is_file() else {"state": "no outcome"}
    state = "hung" if hung else outcome["state"]
    lock_left = (root / "soak" / "stage_2cpu_final" / "RUNNING.lock").exists()
    if scenario in ("sigint", "sigterm") and state == "done" and (signal_at is None or finished_before_signal):
        expected = "done"  # rank 0 had finished before the signal came: done is a known state too
    else:
        expected = EXPECTED[scenario]
    if scenario == "clean" and state == "done" and outcome.get("steps") != steps:
        state = f"done with {outcome.get('steps')} steps"
    row = {
        "i": i, "scenario": scenario, "fault": env.get("LYCHEE_FAULT"), "fault_rank": env.get("LYCHEE_FAULT_RANK"),
        "state": state, "expected": expected, "known_state": state == expected and not orphans and not lock_left,
        "orphans": len(orphans), "lock_left": lock_left, "wall_s": round(ended - started, 2),
        "stop_s": round(ended - signal_at, 2) if signal_at else None,
        "message": (outcome.get("message") or "")[:300], "pairs_per_s": outcome.get("pairs_per_s"),
        "finished_before_signal": finished_before_signal,
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--watchdog-s", type=int, default=10)
    parser.add_argument("--hang-after-exit-s", type=int, default=8)
    parser.add_argument("--hang-after-s", type=float, default=240.0, help="a driver alive this long is a hang")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows and the summary")
    parser.add_argument("--keep", action="store_true", help="keep the stage folders")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--outcome", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.driver:
        return driver(args)

    from lychee_pipeline.training.synthetic import write_colour_item_table

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="lychee_soak_"))
    data = str(write_colour_item_table(work / "data"))
    rows = []
    started = time.monotonic()
    for i in range(args.n):
        scenario = rng.choice(SCENARIOS)
        row = run_one(i, scenario, rng, work, data, args)
        rows.append(row)
        print(f"{i:3d} {scenario:10s} {str(row['fault'] or ''):22s} -> {row['state']:12s} "
              f"{'ok' if row['known_state'] else 'UNEXPECTED':10s} {row['wall_s']:6.1f} s"
              + (f"  stop {row['stop_s']:.1f} s" if row["stop_s"] is not None else "")
              + (f"  orphans {row['orphans']}" if row["orphans"] else "")
              + (f"  | {row['message'][:110]}" if row["message"] and row["state"] != "done" else ""), flush=True)
    summary = {
        "stages": len(rows), "hangs": sum(r["state"] == "hung" for r in rows),
        "orphans": sum(r["orphans"] for r in rows), "locks_left": sum(r["lock_left"] for r in rows),
        "known_state": sum(r["known_state"] for r in rows),
        "by_scenario": {s: sum(r["scenario"] == s for r in rows) for s in EXPECTED},
        "wall_s_median": statistics.median(r["wall_s"] for r in rows) if rows else None,
        "wall_s_max": max((r["wall_s"] for r in rows), default=None),
        "stop_s_max": max((r["stop_s"] for r in rows if r["stop_s"] is not None), default=None),
        "total_s": round(time.monotonic() - started, 1), "seed": args.seed, "steps": args.steps,
        "watchdog_s": args.watchdog_s, "hang_after_exit_s": args.hang_after_exit_s,
    }
    for scenario in EXPECTED:
        walls = [r["wall_s"] for r in rows if r["scenario"] == scenario]
        if walls:
            summary[f"wall_s_{scenario}"] = [min(walls), statistics.median(walls), max(walls)]
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"stage folders kept in {work}")
    return 0 if summary["known_state"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
