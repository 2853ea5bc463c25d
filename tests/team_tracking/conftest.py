"""The team-tracking tests' server: one PostgreSQL-backed `mlflow server` for the folder (team_support.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from team_support import TrackingServer, ensure_driver, ensure_postgres, free_port, server_script


@pytest.fixture(scope="session")
def tracking_server():
    """One PostgreSQL-backed tracking server for the folder's tests (stopped by PID at the end)."""
    script = server_script()
    ensure_postgres(script)
    ensure_driver()
    # PostgreSQL runs as the `postgres` user when the tests run as root: a folder it can enter, outside
    # pytest's own (mode 700) temporary folder
    root = Path(tempfile.mkdtemp(prefix="lychee-team-tracking-"))
    root.chmod(0o755)
    server = TrackingServer(root, free_port(), free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
