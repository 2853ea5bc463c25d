"""The launcher's processes: signals turned into KeyboardInterrupts, the folder lock, the process-group stop,
and where a rank's printed Python stack says it was.

Stopping: the launcher and its ranks run in their own session (process group), so a terminal's Ctrl-C does not
reach them. On KeyboardInterrupt, SIGTERM (turned into `StageInterrupted`) or any other exception while they
run, the whole group is terminated (SIGTERM, then SIGKILL after `STOP_GRACE_S`) and waited for before the
exception goes on. While a launch runs, `<folder>/RUNNING.lock` names the process that owns the folder, so
another run never deletes or reuses it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL grace period for a launch's process group
LOCK_NAME = "RUNNING.lock"


class StageInterrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) stopped the run; a KeyboardInterrupt, so everything treats it as Ctrl-C."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(f"interrupted by {signal_name}")
        self.signal_name = signal_name


class StageBusy(RuntimeError):
    """A stage folder is locked by a live process on this machine."""


last_signal: str | None = None  # the signal our handler last turned into StageInterrupted


def raise_interrupted(signum: int, _frame: Any) -> None:
    """A signal handler: raise StageInterrupted naming the signal (installed for SIGTERM)."""
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
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- the folder lock ------------------------------------------------------------------------------------

def process_start_time(pid: int) -> str | None:
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


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and, given its start time, is still the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    if _zombie(pid):
        return False
    return start is None or process_start_time(pid) in (None, start)


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
    if isinstance(pid, int) and host == socket.gethostname() and pid_alive(pid, owner.get("start")):
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
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "start": process_start_time(os.getpid()),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    os.replace(tmp, lock)
    return lock


# --- stopping a process group ---------------------------------------------------------------------------

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


# --- where a rank was: the stack it printed (SIGUSR1, faulthandler) -------------------------------------

STACK_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')


def short_path(path: str) -> str:
    for marker in ("site-packages/", "src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def innermost(frames: list[str]) -> str:
    """The innermost frame, and the innermost frame of our own code when that is elsewhere (in torch, say)."""
    ours = next((f for f in frames if f.startswith("lychee_pipeline/")), None)
    return frames[0] + (f" (from {ours})" if ours and ours != frames[0] else "")
