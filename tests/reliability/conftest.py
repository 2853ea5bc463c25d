"""Fixtures of the reliability tests (helpers in reliability_helpers.py)."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from reliability_helpers import make_table

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def reliability_table(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("reliability_data")
    path = root / "train.parquet"
    pq.write_table(make_table(root), path)
    return str(path)


@pytest.fixture
def no_fault_env(monkeypatch):
    """No fault injection and no MLflow store inherited from the caller's environment."""
    for name in ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
