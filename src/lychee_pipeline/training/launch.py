"""Launch one training stage as real `accelerate launch` processes and collect its result.

Stage spec -> generated Accelerate config -> subprocess (its output streamed to our log and to
`<stage>/launch.log`) -> `<stage>/result.json`. A failed or hung child raises `StageFailed` naming the
log files and quoting each rank's last lines. While it runs, the ranks' heartbeats feed one progress bar per
stage on a terminal, or a few plain progress lines in a log file (training/progress.py); the ranks' own line
per training step stays in `launch.log`.

Stopping: the launcher and its ranks run in their own session (process group), so a terminal's Ctrl-C does not
reach them. On KeyboardInterrupt, SIGTERM (turned into `StageInterrupted`) or any other exception while they
run, the whole group is terminated (SIGTERM, then SIGKILL after `STOP_GRACE_S`) and waited for before the
exception goes on; the stage's MLflow run left open by rank 0 is ended as KILLED or FAILED. While a stage
runs, `<stage>/RUNNING.lock` names the process that owns the folder, so another run never deletes or reuses it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from lychee_pipeline.training import heartbeat
from lychee_pipeline.training.progress import StageProgress

log = logging.getLogger(__name__)

RANK_PREFIX = re.compile(r"^\[default(\d+)\]:|^\[rank (\d+)\]")  # torchrun's --tee prefix, or our log format
# Library warnings would push a rank's real last words out of the few lines a failure quotes.
NOISE = re.compile(r"(Warning: |^\s*warnings\.warn\()")
# train.py's line per logging step: kept in the stage's launch.log (and MLflow), relayed to our log at DEBUG
# only: the progress display (training/progress.py) stands for them, with the last loss read from them.
STEP_LINE = re.compile(r"\bstep \d+/\d+ loss (?P<loss>\S+)")


STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL grace period for a stage's process group
LOCK_NAME = "RUNNING.lock"


class StageFailed(RuntimeError):
    """A stage's processes failed; the message says where the logs are."""


class StageInterrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) stopped the run; a KeyboardInterrupt, so everything treats it as Ctrl-C."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(f"interrupted by {signal_name}")
        self.signal_name = signal_name


class StageBusy(RuntimeError):
    """A stage folder is locked by a live process on this machine."""


last_signal: str | None = None  # the signal our handler last turned into StageInterrupted


def _raise_interrupted(signum: int, _frame: Any) -> None:
    global last_signal
    last_signal = signal.Signals(signum).name
    raise StageInterrupted(last_signal)


def interrupt_reason(exc: BaseException | None = None) -> str:
    """`interrupted by SIGTERM`, or `interrupted by SIGINT (Ctrl-C)` for a plain KeyboardInterrupt."""
    if isinstance(exc, StageInterrupted):
        return f"interrupted by {exc.signal_name}"
    if exc is None and last_signal:
        return f"interrupted by {last_signal}"
    return "interrupted by SIGINT (Ctrl-C)"


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises StageInterrupted in the main thread while inside (the previous handler comes back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- the stage folder lock ------------------------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The kernel's start time of a process (Linux), so a reused PID is not mistaken for the lock's owner."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _zombie(pid: int) -> bool:
    """Exited but not yet reaped (Linux). A rank's parent, the torchrun agent, reaps its workers only at its next
    look: without this, a rank that left early and the peer that failed right after it look as if they left
    together, and the failure cannot say which one went first."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _pid_alive(pid: int, start: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    if _zombie(pid):
        return False
    return start is None or _start_time(pid) in (None, start)


def check_stage_lock(stage_dir: Path) -> None:
    """Refuse a stage folder whose lock names a live process on this host; remove a stale lock."""
    lock = Path(stage_dir) / LOCK_NAME
    try:
        owner = json.loads(lock.read_text())
    except FileNotFoundError:
        return
    except ValueError:
        owner = {}
    pid, host = owner.get("pid"), owner.get("host")
    if isinstance(pid, int) and host == socket.gethostname() and _pid_alive(pid, owner.get("start")):
        if pid == os.getpid():
            return  # our own lock (a re-entry in the same process)
        raise StageBusy(f"stage folder {stage_dir} is in use by process {pid} on {host} (lock {lock}); "
                        f"stop that run first, or delete the lock if you are sure it is gone")
    if isinstance(pid, int) and host and host != socket.gethostname():
        log.warning("stage folder %s has a lock from process %s on another host %s; going on", stage_dir, pid, host)
        return
    log.info("removing stale lock %s (process %s on %s is gone)", lock, pid, host)
    lock.unlink(missing_ok=True)


def write_stage_lock(stage_dir: Path) -> Path:
    lock = Path(stage_dir) / LOCK_NAME
    tmp = lock.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    os.replace(tmp, lock)
    return lock


def stop_process_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group led by `process`, SIGKILL what is left after `grace_s`, and reap the leader."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process.poll() is not None and not _group_alive(process.pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


STACK_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')
STACK_WAIT_S = 2.0  # after SIGUSR1, for the ranks' stacks to reach the log


def _short_path(path: str) -> str:
    for marker in ("site-packages/", "src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _where(frames: list[str]) -> str:
    """The innermost frame, and the innermost frame of our own code when that is elsewhere (in torch, say)."""
    ours = next((f for f in frames if f.startswith("lychee_pipeline/")), None)
    return frames[0] + (f" (from {ours})" if ours and ours != frames[0] else "")


class Watchdog:
    """Reads the ranks' heartbeat files (training/heartbeat.py) and says when a stage must be stopped.

    `check()` returns None while the stage is healthy, else (kind, one-line reason): `hung` (a rank exited or
    said done while another alive one made no progress for `hang_after_exit_s`), `silent` (an alive rank made
    no progress for `watchdog_s`), `rendezvous` (no rank of this machine got past the rendezvous in
    `rendezvous_timeout_s`) or `teardown` (every rank said done, result written, one process did not exit).
    """

    def __init__(self, stage_dir: Path, launch: dict[str, Any], devices: int, port: int | None = None):
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
            if b.get("host") in (self.host, os.uname().nodename) and _pid_alive(int(b["pid"])):
                with contextlib.suppress(OSError):
                    os.kill(int(b["pid"]), heartbeat.STACK_SIGNAL)
                    asked = True
        return asked

    def _alive(self, record: dict) -> bool:
        return record.get("host") not in (None, self.host, os.uname().nodename) or _pid_alive(int(record["pid"]))

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
            limit = launch.get("rendezvous_timeout_s", 900)
            if now - self.started <= limit:
                return None
            machines, me = launch.get("num_machines", 1), launch.get("machine_rank", 0)
            where = f"{launch.get('main_process_ip') or '127.0.0.1'}:{self.port or launch.get('main_process_port')}"
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
            limit = launch.get("hang_after_exit_s", 120)
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
        limit = launch.get("watchdog_s", 1800)
        startup = max(limit, launch.get("rendezvous_timeout_s", 900))

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


def free_port() -> int:
    """A free TCP port on loopback for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is visible, else cpu."""
    if device not in {"auto", "cuda", "cpu"}:
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device_count(devices: int, device_type: str) -> None:
    """Refuse more GPUs than are visible, before anything launches."""
    if device_type != "cuda":
        return
    import torch

    visible = torch.cuda.device_count()
    if devices > visible:
        raise ValueError(f"gpus={devices} asks for more GPUs than the {visible} visible on this machine")


def accelerate_config(
    devices: int, device_type: str, launch: dict[str, Any], template: dict[str, Any] | None
) -> dict[str, Any]:
    """The Accelerate config for a stage: DDP by default, or a DeepSpeed / FSDP template from conf/."""
    mixed = launch["mixed_precision"]
    if mixed == "auto":
        mixed = "bf16" if device_type == "cuda" else "no"
    config: dict[str, Any] = dict(template or {})
    multi = devices * launch["num_machines"] > 1
    if not template:
        config["distributed_type"] = "MULTI_GPU" if multi else "NO"
    config.update(
        compute_environment="LOCAL_MACHINE",
        num_processes=devices * launch["num_machines"],
        num_machines=launch["num_machines"],
        machine_rank=launch["machine_rank"],
        main_process_port=launch["main_process_port"] or free_port(),
        mixed_precision=mixed,
        dynamo_config={"dynamo_backend": "NO"},
        use_cpu=device_type == "cpu" and not multi,
        rdzv_backend="static",
        same_network=True,
    )
    if launch.get("main_process_ip"):
        config["main_process_ip"] = launch["main_process_ip"]
    return config


def child_environment(device_type: str, launch: dict[str, Any], tracking: dict[str, str]) -> dict[str, str]:
    """The children's environment: telemetry off, threads pinned on CPU, MLflow run ids passed down."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        KEDRO_DISABLE_TELEMETRY="1",
        MLFLOW_DISABLE_TELEMETRY="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if device_type == "cpu":
        threads = str(launch["threads_per_process"])
        # Accelerate only uses gloo on a machine without CUDA when told to use the CPU.
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   CUDA_VISIBLE_DEVICES="")
    env.update(tracking)
    return env


def run_stage(
    stage_dir: Path,
    spec: dict[str, Any],
    devices: int,
    device_type: str,
    template: dict[str, Any] | None = None,
    tracking_env: dict[str, str] | None = None,
    module: str = "lychee_pipeline.training.train",
) -> dict[str, Any]:
    """Run one stage to completion and return its result.json, or raise StageFailed.

    `module` is the entry point each process runs with `--spec <file>` (the evaluation's sharded scoring
    uses `lychee_pipeline.evaluation.score_shards`)."""
    launch = spec["training"]["launch"]
    stage_dir.mkdir(parents=True, exist_ok=True)
    check_stage_lock(stage_dir)
    lock = write_stage_lock(stage_dir)
    try:
        with sigterm_raises():
            return _run_stage(stage_dir, spec, devices, device_type, template, tracking_env or {}, module)
    finally:
        lock.unlink(missing_ok=True)


def _run_stage(
    stage_dir: Path, spec: dict[str, Any], devices: int, device_type: str, template: dict[str, Any] | None,
    tracking_env: dict[str, str], module: str = "lychee_pipeline.training.train",
) -> dict[str, Any]:
    launch = spec["training"]["launch"]
    spec_path = stage_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    config = accelerate_config(devices, device_type, launch, template)
    config_path = stage_dir / "accelerate.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    (stage_dir / "result.json").unlink(missing_ok=True)
    heartbeat.clear(stage_dir)
    rank_logs = stage_dir / "rank_logs"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path)]
    if config["num_processes"] > 1:
        command += ["--log_dir", str(rank_logs), "--tee", "3", "--monitor_interval", "1"]
    command += ["-m", module, "--spec", str(spec_path)]
    env = child_environment(device_type, launch, tracking_env)
    log_path = stage_dir / "launch.log"
    log.info("stage %s: %d %s process(es): %s", spec["stage"], config["num_processes"],
             "GPU" if device_type == "cuda" else "CPU", " ".join(command))

    last_lines: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=8))
    stacks: dict[str, list[str]] = {}  # rank -> innermost frames of a stack it printed (SIGUSR1, faulthandler)
    in_stack: set[str] = set()
    progress = StageProgress(spec["stage"])
    with open(log_path, "w", encoding="utf-8") as log_file:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
            start_new_session=True,  # so a timeout can stop the launcher and every rank together
        )

        def pump() -> None:
            for line in process.stdout:  # type: ignore[union-attr]
                log_file.write(line)
                log_file.flush()
                line = line.rstrip()
                match = RANK_PREFIX.match(line)
                rank = next((g for g in match.groups() if g is not None), None) if match else None
                who = f"rank {rank}" if rank is not None else "launcher"
                text = line[match.end():] if match else line
                if heartbeat.STACK_HEADER in text:
                    in_stack.add(who)
                    stacks[who] = []
                elif who in in_stack:
                    frame = STACK_FRAME.match(text)
                    if frame and len(stacks[who]) < 12:
                        stacks[who].append(f"{_short_path(frame.group(1))}:{frame.group(2)} {frame.group(3)}")
                    elif not frame:
                        in_stack.discard(who)
                if not NOISE.search(text) and who not in in_stack and heartbeat.STACK_HEADER not in text:
                    last_lines[who].append(line)
                step_line = STEP_LINE.search(text)
                if step_line:
                    with contextlib.suppress(ValueError):
                        progress.note_loss(float(step_line["loss"]))
                if line:
                    (log.debug if step_line else log.info)("%s", line, extra={"markup": False})  # not rich markup

        reader = threading.Thread(target=pump, daemon=True)
        safety_net = lambda: stop_process_group(process, grace_s=2.0) if process.poll() is None else None  # noqa: E731
        atexit.register(safety_net)  # an exit we did not see coming still takes the stage's processes along
        deadline = time.monotonic() + launch["timeout_s"]
        timed_out = False
        watchdog = Watchdog(stage_dir, launch, devices, config["main_process_port"])
        stopped: tuple[str, str] | None = None  # (kind, reason) when the watchdog stopped the stage
        next_check = time.monotonic() + 1.0
        try:
            reader.start()
            while process.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    stop_process_group(process, grace_s=30)
                    break
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 1.0
                    stopped = watchdog.check()
                    progress.update(watchdog.beats)
                    if stopped:
                        progress.close()
                        log.error("stage %s: %s", spec["stage"], stopped[1])
                        if stopped[0] in ("silent", "hung"):  # where each alive rank is, before it is stopped
                            if watchdog.ask_for_stacks():
                                time.sleep(STACK_WAIT_S)
                        stop_process_group(process, grace_s=5)
                        break
                watchdog.note_exits()
                time.sleep(0.2)
            process.wait()
        except BaseException as exc:  # Ctrl-C, SIGTERM, anything: nothing of the stage may outlive us
            progress.close()
            interrupted = isinstance(exc, KeyboardInterrupt)
            log.warning("stage %s: %s; stopping the launcher and its ranks (process group %d)", spec["stage"],
                        str(exc) or type(exc).__name__ if interrupted else f"{type(exc).__name__}: {exc}", process.pid)
            stop_process_group(process)
            reader.join(timeout=5)
            reason = interrupt_reason(exc) if interrupted else f"{type(exc).__name__}: {exc}"
            end_stage_runs(tracking_env, "KILLED" if interrupted else "FAILED", reason)
            # only a training stage resumes (from its checkpoints); other launches (the sharded scoring) start over
            log.warning("stage %s: stopped; its folder %s is left %s", spec["stage"], stage_dir,
                        "for a resume (training.resume: true)" if module == "lychee_pipeline.training.train" else
                        "as it is (launch.log says how far it got); the next run starts this work again")
            raise
        finally:
            atexit.unregister(safety_net)
        reader.join(timeout=10)
        progress.update(heartbeat.read_heartbeats(stage_dir))  # the last steps, done since the last look
        progress.close()

    result_path = stage_dir / "result.json"
    if stopped and stopped[0] == "teardown" and result_path.is_file():
        log.warning("stage %s: its work is done (result.json written) but %s", spec["stage"], stopped[1])
        return json.loads(result_path.read_text())
    machine_rank, machines = launch.get("machine_rank", 0), launch.get("num_machines", 1)
    if machine_rank > 0 and not (timed_out or stopped) and process.returncode == 0:
        # Another machine's rank 0 writes result.json (into its own stage folder); ours only trained.
        log.info("stage %s: machine rank %d of %d done (the result is written on machine rank 0)",
                 spec["stage"], machine_rank, machines)
        return {"stage": spec["stage"], "machine_rank": machine_rank, "num_machines": machines,
                "result_on_machine_rank_0": True, "progress": watchdog.describe()}
    if timed_out or stopped or process.returncode != 0 or not result_path.is_file():
        if stopped:
            why = f"stopped by the watchdog: {stopped[1]}"
        elif timed_out:
            why = f"timed out after {launch['timeout_s']} s"
        else:
            why = f"exited with code {process.returncode}"
        if config["num_processes"] > 1:  # name every rank, also one that died before it said anything
            for rank in range(config["num_processes"]):
                last_lines.setdefault(f"rank {rank}", collections.deque(["(no output)"]))
        if stacks:
            why += ". Where the ranks were: " + "; ".join(
                f"{who} in {_where(frames)}" for who, frames in sorted(stacks.items()) if frames)
        tails = "\n".join(
            f"  {who}:\n" + "\n".join(f"    {line}" for line in lines) for who, lines in sorted(last_lines.items())
        )
        end_stage_runs(tracking_env, "FAILED", f"stage {why}")
        raise StageFailed(
            f"training stage {spec['stage']!r} {why}. Full log: {log_path}"
            + (f"; per-rank logs: {rank_logs}" if rank_logs.exists() else "")
            + f"\nProgress: {watchdog.describe()}"
            + f"\nLast lines:\n{tails}"
        )
    return json.loads(result_path.read_text())


def end_stage_runs(tracking_env: dict[str, str], status: str, reason: str) -> list[str]:
    """End the stage runs under the parent MLflow run that are still RUNNING (rank 0 could not), with a reason.

    Returns the run ids it ended. Never raises: the stage's own error is the one that matters.
    """
    parent, uri = tracking_env.get("LYCHEE_MLFLOW_PARENT_RUN_ID"), tracking_env.get("MLFLOW_TRACKING_URI")
    if not parent or not uri:
        return []
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs(
            [tracking_env["LYCHEE_MLFLOW_EXPERIMENT_ID"]] if tracking_env.get("LYCHEE_MLFLOW_EXPERIMENT_ID") else [],
            filter_string=f"tags.mlflow.parentRunId = '{parent}' and attributes.status = 'RUNNING'",
        )
        ended = []
        for run in runs:
            client.set_tag(run.info.run_id, "failure_reason", reason[:5000])
            client.set_terminated(run.info.run_id, status)
            ended.append(run.info.run_id)
            log.info("MLflow stage run %s ended as %s (%s)", run.info.run_id, status, reason.splitlines()[0])
        return ended
    except Exception as exc:  # noqa: BLE001
        log.warning("could not end the open MLflow stage runs: %s: %s", type(exc).__name__, exc)
        return []
