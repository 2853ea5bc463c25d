"""Launch a typed job as real `accelerate launch` processes and collect its result.

`LaunchJob` (entry module, spec file, devices, launch settings, work folder) -> generated Accelerate config ->
subprocess (its output streamed to our log and to `<folder>/launch.log`) -> `<folder>/result.json`. The spec
file is opaque here: the entry module reads it (`python -m <module> --spec <file>`). A failed or hung child
raises `StageFailed` naming the log files and quoting each rank's last lines. While it runs, the ranks'
heartbeats feed one progress bar on a terminal, or a few plain progress lines in a log file (runtime/progress.py);
the ranks' own line per training step stays in `launch.log`.

Stopping (runtime/processes.py): on KeyboardInterrupt, SIGTERM or any other exception while the job runs, its
whole process group is stopped and waited for before the exception goes on, and the job's `on_stop` is called
(training ends the stage's MLflow runs there). While it runs, `<folder>/RUNNING.lock` names the owning process.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lychee_pipeline.runtime import heartbeat
from lychee_pipeline.runtime.processes import (
    STACK_FRAME,
    check_stage_lock,
    innermost,
    interrupt_reason,
    short_path,
    sigterm_raises,
    stop_process_group,
    write_stage_lock,
)
from lychee_pipeline.runtime.progress import StageProgress
from lychee_pipeline.runtime.settings import LaunchParams
from lychee_pipeline.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)

RANK_PREFIX = re.compile(r"^\[default(\d+)\]:|^\[rank (\d+)\]")  # torchrun's --tee prefix, or our log format
# Library warnings would push a rank's real last words out of the few lines a failure quotes.
NOISE = re.compile(r"(Warning: |^\s*warnings\.warn\()")
# train.py's line per logging step: kept in the stage's launch.log (and MLflow), relayed to our log at DEBUG
# only: the progress display (runtime/progress.py) stands for them, with the last loss read from them.
STEP_LINE = re.compile(r"\bstep \d+/\d+ loss (?P<loss>\S+)")
STACK_WAIT_S = 2.0  # after SIGUSR1, for the ranks' stacks to reach the log
RESULT_FILE = "result.json"


class StageFailed(RuntimeError):
    """A launched job's processes failed; the message says where the logs are."""


@dataclass(frozen=True)
class LaunchJob:
    """One `accelerate launch`: each process runs `python -m <module> --spec <spec_file>`.

    The spec is opaque to the launcher: the caller serializes its own typed spec (a training `StageSpec`, an
    evaluation `ScoringJobSpec`) and the entry module reads it back.

    `folder` holds launch.log, rank_logs/, heartbeat/, accelerate.yaml, the lock and the entry module's
    result.json. `what` names the job in the failure message (`training stage 'stage_2cpu'`).
    """

    name: str
    module: str
    spec_file: Path
    spec_text: str  # what the launcher writes to spec_file once it holds the folder's lock (JSON, opaque here)
    folder: Path
    devices: int
    device_type: str  # cuda or cpu
    launch: LaunchParams
    template: dict[str, Any] | None = None  # an Accelerate template (DeepSpeed, FSDP); None: DDP
    env: dict[str, str] = field(default_factory=dict)  # added to the children's environment
    what: str = ""
    on_stop: Callable[[str, str], Any] | None = None  # (KILLED or FAILED, reason) when the job is stopped or fails
    # what becomes of the folder when the job is stopped: a training stage resumes from its checkpoints, other
    # launches (the sharded scoring) start over
    left_for: str = "as it is (launch.log says how far it got); the next run starts this work again"

    @property
    def label(self) -> str:
        return self.what or f"job {self.name!r}"


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
    devices: int, device_type: str, launch: LaunchParams, template: dict[str, Any] | None
) -> dict[str, Any]:
    """The Accelerate config for a launch: DDP by default, or a DeepSpeed / FSDP template from conf/."""
    mixed = launch.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if device_type == "cuda" else "no"
    config: dict[str, Any] = dict(template or {})
    multi = devices * launch.num_machines > 1
    if not template:
        config["distributed_type"] = "MULTI_GPU" if multi else "NO"
    config.update(
        compute_environment="LOCAL_MACHINE",
        num_processes=devices * launch.num_machines,
        num_machines=launch.num_machines,
        machine_rank=launch.machine_rank,
        main_process_port=launch.main_process_port or free_port(),
        mixed_precision=mixed,
        dynamo_config={"dynamo_backend": "NO"},
        use_cpu=device_type == "cpu" and not multi,
        rdzv_backend="static",
        same_network=True,
    )
    if launch.main_process_ip:
        config["main_process_ip"] = launch.main_process_ip
    return config


def child_environment(device_type: str, launch: LaunchParams, extra: dict[str, str]) -> dict[str, str]:
    """The children's environment: telemetry off, threads pinned on CPU, the job's own variables (MLflow run ids)."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        KEDRO_DISABLE_TELEMETRY="1",
        MLFLOW_DISABLE_TELEMETRY="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if device_type == "cpu":
        threads = str(launch.threads_per_process)
        # Accelerate only uses gloo on a machine without CUDA when told to use the CPU.
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def launch(job: LaunchJob) -> dict[str, Any]:
    """Run the job to completion and return its result.json, or raise StageFailed (the folder is locked while
    it runs; SIGTERM raises StageInterrupted in here)."""
    job.folder.mkdir(parents=True, exist_ok=True)
    check_stage_lock(job.folder)
    lock = write_stage_lock(job.folder)
    try:
        with sigterm_raises():
            return _run(job)
    finally:
        lock.unlink(missing_ok=True)


class LogRelay:
    """Reads the launcher's merged output: writes it to launch.log, relays it to our log, keeps each rank's
    last lines and the stacks the ranks print, and feeds the last loss to the progress display."""

    def __init__(self, log_file: Any, progress: StageProgress):
        self.log_file, self.progress = log_file, progress
        self.last_lines: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=8))
        self.stacks: dict[str, list[str]] = {}  # rank -> innermost frames of a stack it printed
        self.in_stack: set[str] = set()

    def pump(self, stream: Any) -> None:
        for line in stream:
            self.log_file.write(line)
            self.log_file.flush()
            self.take(line.rstrip())

    def take(self, line: str) -> None:
        match = RANK_PREFIX.match(line)
        rank = next((g for g in match.groups() if g is not None), None) if match else None
        who = f"rank {rank}" if rank is not None else "launcher"
        text = line[match.end():] if match else line
        if heartbeat.STACK_HEADER in text:
            self.in_stack.add(who)
            self.stacks[who] = []
        elif who in self.in_stack:
            frame = STACK_FRAME.match(text)
            if frame and len(self.stacks[who]) < 12:
                self.stacks[who].append(f"{short_path(frame.group(1))}:{frame.group(2)} {frame.group(3)}")
            elif not frame:
                self.in_stack.discard(who)
        if not NOISE.search(text) and who not in self.in_stack and heartbeat.STACK_HEADER not in text:
            self.last_lines[who].append(line)
        step_line = STEP_LINE.search(text)
        if step_line:
            with contextlib.suppress(ValueError):
                self.progress.note_loss(float(step_line["loss"]))
        if line:
            (log.debug if step_line else log.info)("%s", line, extra={"markup": False})  # not rich markup


@dataclass
class Supervision:
    """How the launch ended: timed out, stopped by the watchdog ((kind, reason)), or neither."""

    timed_out: bool = False
    stopped: tuple[str, str] | None = None


def _command(job: LaunchJob, config: dict[str, Any], config_path: Path, rank_logs: Path) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path)]
    if config["num_processes"] > 1:
        command += ["--log_dir", str(rank_logs), "--tee", "3", "--monitor_interval", "1"]
    return command + ["-m", job.module, "--spec", str(job.spec_file)]


def _run(job: LaunchJob) -> dict[str, Any]:
    job.spec_file.write_text(job.spec_text)
    config = accelerate_config(job.devices, job.device_type, job.launch, job.template)
    config_path = job.folder / "accelerate.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    (job.folder / RESULT_FILE).unlink(missing_ok=True)
    heartbeat.clear(job.folder)
    rank_logs = job.folder / "rank_logs"
    command = _command(job, config, config_path, rank_logs)
    log_path = job.folder / "launch.log"
    log.info("stage %s: %d %s process(es): %s", job.name, config["num_processes"],
             "GPU" if job.device_type == "cuda" else "CPU", " ".join(command))
    progress = StageProgress(job.name)
    watchdog = Watchdog(job.folder, job.launch, job.devices, config["main_process_port"])
    with open(log_path, "w", encoding="utf-8") as log_file:
        relay = LogRelay(log_file, progress)
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=child_environment(job.device_type, job.launch, job.env),
            start_new_session=True,  # so a timeout can stop the launcher and every rank together
        )
        reader = threading.Thread(target=relay.pump, args=(process.stdout,), daemon=True)
        safety_net = lambda: stop_process_group(process, grace_s=2.0) if process.poll() is None else None  # noqa: E731
        atexit.register(safety_net)  # an exit we did not see coming still takes the job's processes along
        try:
            reader.start()
            ended = _supervise(job, process, watchdog, progress)
        except BaseException as exc:  # Ctrl-C, SIGTERM, anything: nothing of the job may outlive us
            _stop_on(exc, job, process, progress)
            reader.join(timeout=5)
            raise
        finally:
            atexit.unregister(safety_net)
        reader.join(timeout=10)
        progress.update(heartbeat.read_heartbeats(job.folder))  # the last steps, done since the last look
        progress.close()
    return _outcome(job, config, process, ended, watchdog, relay, log_path, rank_logs)


def _supervise(job: LaunchJob, process: subprocess.Popen, watchdog: Watchdog, progress: StageProgress
               ) -> Supervision:
    """Wait for the launcher, checking the heartbeats every second and the wall-clock limit."""
    ended = Supervision()
    deadline = time.monotonic() + job.launch.timeout_s
    next_check = time.monotonic() + 1.0
    while process.poll() is None:
        if time.monotonic() > deadline:
            ended.timed_out = True
            stop_process_group(process, grace_s=30)
            break
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + 1.0
            ended.stopped = watchdog.check()
            progress.update(watchdog.beats)
            if ended.stopped:
                progress.close()
                log.error("stage %s: %s", job.name, ended.stopped[1])
                if ended.stopped[0] in ("silent", "hung"):  # where each alive rank is, before it is stopped
                    if watchdog.ask_for_stacks():
                        time.sleep(STACK_WAIT_S)
                stop_process_group(process, grace_s=5)
                break
        watchdog.note_exits()
        time.sleep(0.2)
    process.wait()
    return ended


def _stop_on(exc: BaseException, job: LaunchJob, process: subprocess.Popen, progress: StageProgress) -> None:
    progress.close()
    interrupted = isinstance(exc, KeyboardInterrupt)
    log.warning("stage %s: %s; stopping the launcher and its ranks (process group %d)", job.name,
                str(exc) or type(exc).__name__ if interrupted else f"{type(exc).__name__}: {exc}", process.pid)
    stop_process_group(process)
    if job.on_stop is not None:
        job.on_stop("KILLED" if interrupted else "FAILED",
                    interrupt_reason(exc) if interrupted else f"{type(exc).__name__}: {exc}")
    log.warning("stage %s: stopped; its folder %s is left %s", job.name, job.folder, job.left_for)


def _outcome(job: LaunchJob, config: dict[str, Any], process: subprocess.Popen, ended: Supervision,
             watchdog: Watchdog, relay: LogRelay, log_path: Path, rank_logs: Path) -> dict[str, Any]:
    """The result.json, a machine share's stand-in, or StageFailed naming why, the logs and the last lines."""
    result_path = job.folder / RESULT_FILE
    stopped, launch = ended.stopped, job.launch
    if stopped and stopped[0] == "teardown" and result_path.is_file():
        log.warning("stage %s: its work is done (result.json written) but %s", job.name, stopped[1])
        return json.loads(result_path.read_text())
    machine_rank, machines = launch.machine_rank, launch.num_machines
    if machine_rank > 0 and not (ended.timed_out or stopped) and process.returncode == 0:
        # Another machine's rank 0 writes result.json (into its own folder); ours only trained.
        log.info("stage %s: machine rank %d of %d done (the result is written on machine rank 0)",
                 job.name, machine_rank, machines)
        return {"stage": job.name, "machine_rank": machine_rank, "num_machines": machines,
                "result_on_machine_rank_0": True, "progress": watchdog.describe()}
    if not (ended.timed_out or stopped or process.returncode != 0 or not result_path.is_file()):
        return json.loads(result_path.read_text())
    if stopped:
        why = f"stopped by the watchdog: {stopped[1]}"
    elif ended.timed_out:
        why = f"timed out after {launch.timeout_s} s"
    else:
        why = f"exited with code {process.returncode}"
    last_lines = relay.last_lines
    if config["num_processes"] > 1:  # name every rank, also one that died before it said anything
        for rank in range(config["num_processes"]):
            last_lines.setdefault(f"rank {rank}", collections.deque(["(no output)"]))
    if relay.stacks:
        why += ". Where the ranks were: " + "; ".join(
            f"{who} in {innermost(frames)}" for who, frames in sorted(relay.stacks.items()) if frames)
    tails = "\n".join(
        f"  {who}:\n" + "\n".join(f"    {line}" for line in lines) for who, lines in sorted(last_lines.items())
    )
    if job.on_stop is not None:
        job.on_stop("FAILED", f"stage {why}")
    raise StageFailed(
        f"{job.label} {why}. Full log: {log_path}"
        + (f"; per-rank logs: {rank_logs}" if rank_logs.exists() else "")
        + f"\nProgress: {watchdog.describe()}"
        + f"\nLast lines:\n{tails}"
    )
