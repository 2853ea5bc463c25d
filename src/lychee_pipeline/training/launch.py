"""Launch one training stage as real `accelerate launch` processes and collect its result.

Stage spec -> generated Accelerate config -> subprocess (its output streamed to our log and to
`<stage>/launch.log`) -> `<stage>/result.json`. A failed or hung child raises `StageFailed` naming the
log files and quoting each rank's last lines.

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

log = logging.getLogger(__name__)

RANK_PREFIX = re.compile(r"^\[default(\d+)\]:|^\[rank (\d+)\]")  # torchrun's --tee prefix, or our log format
# Library warnings would push a rank's real last words out of the few lines a failure quotes.
NOISE = re.compile(r"(Warning: |^\s*warnings\.warn\()")


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


def _pid_alive(pid: int, start: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
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
                if not NOISE.search(line[match.end():] if match else line):
                    last_lines[f"rank {rank}" if rank is not None else "launcher"].append(line)
                if line:
                    log.info("%s", line, extra={"markup": False})  # child output is not rich markup

        reader = threading.Thread(target=pump, daemon=True)
        safety_net = lambda: stop_process_group(process, grace_s=2.0) if process.poll() is None else None  # noqa: E731
        atexit.register(safety_net)  # an exit we did not see coming still takes the stage's processes along
        deadline = time.monotonic() + launch["timeout_s"]
        timed_out = False
        try:
            reader.start()
            while process.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    stop_process_group(process, grace_s=30)
                    break
                time.sleep(0.2)
            process.wait()
        except BaseException as exc:  # Ctrl-C, SIGTERM, anything: nothing of the stage may outlive us
            interrupted = isinstance(exc, KeyboardInterrupt)
            log.warning("stage %s: %s; stopping the launcher and its ranks (process group %d)", spec["stage"],
                        str(exc) or type(exc).__name__ if interrupted else f"{type(exc).__name__}: {exc}", process.pid)
            stop_process_group(process)
            reader.join(timeout=5)
            reason = interrupt_reason(exc) if interrupted else f"{type(exc).__name__}: {exc}"
            end_stage_runs(tracking_env, "KILLED" if interrupted else "FAILED", reason)
            log.warning("stage %s: stopped; its folder %s is left for a resume (training.resume: true)",
                        spec["stage"], stage_dir)
            raise
        finally:
            atexit.unregister(safety_net)
        reader.join(timeout=10)

    result_path = stage_dir / "result.json"
    if timed_out or process.returncode != 0 or not result_path.is_file():
        why = f"timed out after {launch['timeout_s']} s" if timed_out else f"exited with code {process.returncode}"
        if config["num_processes"] > 1:  # name every rank, also one that died before it said anything
            for rank in range(config["num_processes"]):
                last_lines.setdefault(f"rank {rank}", collections.deque(["(no output)"]))
        tails = "\n".join(
            f"  {who}:\n" + "\n".join(f"    {line}" for line in lines) for who, lines in sorted(last_lines.items())
        )
        end_stage_runs(tracking_env, "FAILED", f"stage {why}")
        raise StageFailed(
            f"training stage {spec['stage']!r} {why}. Full log: {log_path}"
            + (f"; per-rank logs: {rank_logs}" if rank_logs.exists() else "")
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
