"""Helpers of the team-tracking tests: a real PostgreSQL under a real `mlflow server --serve-artifacts`, started
by `scripts/tracking_server.py` exactly as `make tracking-server` starts it, on free loopback ports, and project
copies that log to it through the `kedro` CLI.

On a fresh machine the suite installs what it needs: Debian's `postgresql` package (root with apt-get, as CI
runs) and the `psycopg` driver (the dev extra has it; pip otherwise). Where neither works it skips, in one line
naming the missing piece. Every server it starts is stopped by PID: the script (SIGTERM: it stops mlflow's
process group and PostgreSQL), then, should it hang, the script's and mlflow's process groups and PostgreSQL
by the PIDs the script printed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "tracking_server.py"
# COLUMNS: rich (Kedro's traceback printer) wraps at 80 columns in a pipe; a one-line error stays one line here
QUIET_ENV = {"KEDRO_DISABLE_TELEMETRY": "1", "MLFLOW_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
             "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "1000"}
STARTUP_LIMIT_S = 240  # PostgreSQL + mlflow server on a loaded 2-core machine (about 11 s when idle)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """A child's environment: telemetry off, no MLflow store or credentials of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LYCHEE_"))}
    env.update(QUIET_ENV)
    env.update(extra)
    return env


def server_script():
    spec = importlib.util.spec_from_file_location("tracking_server", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def ensure_postgres(script) -> None:
    """PostgreSQL's server programs, installed from Debian's package where missing; else skip in one line."""
    try:
        script.postgres_bin()
        return
    except script.SetupError:
        pass
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("team tracking: PostgreSQL server (initdb) not installed, and installing it needs root with "
                    "apt-get (apt-get install postgresql)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    result = subprocess.run("apt-get update -qq && apt-get install -y -qq postgresql", shell=True, env=env,
                            capture_output=True, text=True, timeout=900)
    try:
        script.postgres_bin()
    except script.SetupError:
        pytest.skip(f"team tracking: PostgreSQL server not installable here (apt-get install postgresql: "
                    f"{_last_line(result.stderr or result.stdout)})")


def ensure_driver() -> None:
    """The psycopg driver in this environment (the dev extra brings it), pip-installed where missing."""
    try:
        import psycopg  # noqa: F401
        return
    except ImportError:
        pass
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"),
                             "psycopg[binary]"], capture_output=True, text=True, timeout=600)
    importlib.invalidate_caches()
    try:
        import psycopg  # noqa: F401, F811
    except ImportError:
        pytest.skip(f"team tracking: PostgreSQL driver psycopg not installable here "
                    f"({_last_line(result.stderr or result.stdout)})")


class TrackingServer:
    """`scripts/tracking_server.py` in a child process: start, kill mlflow as a crash would, stop, start again."""

    def __init__(self, root: Path, port: int, pg_port: int):
        self.root, self.port, self.pg_port = root, port, pg_port
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.pids: dict[str, int] = {}
        self.log = root / "script.log"
        self.starts: list[float] = []  # seconds from start to the printed URI

    def start(self) -> None:
        started = time.monotonic()
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--root", str(self.root / "server"), "--port", str(self.port),
                 "--pg-port", str(self.pg_port)],
                cwd=REPO, env=clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            text = self.log.read_text(errors="replace")[offset:]
            if f"export MLFLOW_TRACKING_URI={self.uri}" in text:
                found = re.search(r"PIDs: PostgreSQL (\d+), mlflow server (\d+)", text)
                self.pids = {"postgres": int(found[1]), "mlflow": int(found[2])}
                self.starts.append(time.monotonic() - started)
                return
            if self.proc.poll() is not None or time.monotonic() - started > STARTUP_LIMIT_S:
                self.stop()
                pytest.fail(f"the tracking server did not start:\n{text[-3000:]}\n"
                            f"mlflow.log: {self._tail('mlflow.log')}\npostgres.log: {self._tail('postgres.log')}")
            time.sleep(0.3)

    def _tail(self, name: str) -> str:
        path = self.root / "server" / name
        return path.read_text(errors="replace")[-2000:] if path.is_file() else "(none)"

    def kill_mlflow(self) -> None:
        """The tracking server dies (SIGKILL to mlflow's process group); the script then stops PostgreSQL."""
        os.killpg(self.pids["mlflow"], signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # by its PID: it stops mlflow's group, then PostgreSQL
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for name, pid in self.pids.items():  # whatever outlived the script, by the PIDs it printed
            try:
                os.killpg(pid, signal.SIGKILL) if name == "mlflow" else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
