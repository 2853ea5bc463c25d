"""Fixtures of the user-tool tests: a fresh-clone-like project copy, and one with the data pipeline run."""

from __future__ import annotations

from pathlib import Path

import pytest

from user_tools_support import DATA_PARAMS, kedro, make_project_copy


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    return make_project_copy(tmp_path / "project")


@pytest.fixture(scope="session")
def data_project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A project copy after ``kedro run --pipeline data`` (demo data): data/01–05 and one MLflow run."""
    project = make_project_copy(tmp_path_factory.mktemp("user_tools") / "project")
    proc = kedro(project, "run", "--pipeline", "data", "--params", DATA_PARAMS)
    return {"path": project, "stdout": proc.stdout, "stderr": proc.stderr}
