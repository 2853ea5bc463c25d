"""notebooks/01_explore_data_and_results.ipynb runs top to bottom with nbclient, as a user runs it.

It runs in a project copy where only ``kedro run --pipeline data`` has run (the CI case: the results
section must say that there is no evaluation output yet, not fail). The results section is also run on
real outputs when a smoke-run project is at hand: ``LYCHEE_SMOKE_PROJECT=<folder>`` or a session-scoped
``smoke_project`` fixture in tests/conftest.py (the notebook only reads; the kernel's working directory is
``<folder>/notebooks``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from user_tools_support import REPO, QUIET_ENV

NOTEBOOK = "notebooks/01_explore_data_and_results.ipynb"


def _execute(project: Path, monkeypatch) -> tuple[nbformat.NotebookNode, str]:
    """Execute the notebook of the checkout with its working directory in ``project``/notebooks."""
    nb = nbformat.read(REPO / NOTEBOOK, as_version=4)
    # first cell: which interpreter the kernel runs (it must be this venv's)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print('KERNEL', sys.executable)"))
    workdir = project / "notebooks"
    workdir.mkdir(exist_ok=True)
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LYCHEE_PROJECT_PATH", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # kernel "python3" is ipykernel's own spec; jupyter_client starts it with sys.executable
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    client.execute()
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif "data" in out and "text/plain" in out["data"]:
                text.append(out["data"]["text/plain"])
    return nb, "\n".join(text)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_notebook_runs_on_the_data_pipeline_outputs(data_project, monkeypatch):
    nb, text = _execute(data_project["path"], monkeypatch)
    assert f"KERNEL {sys.executable}" in text or f"KERNEL {os.path.realpath(sys.executable)}" in text, text[:300]
    assert f"project: {data_project['path']}" in text
    assert " records" in text and "task_type" in text
    assert "rejected lines: 0" in text and "quarantined_records: 0" in text
    assert "No evaluation output yet" in text  # said, not raised
    assert "evaluation_metrics: not written yet" in text
    assert _images(nb) >= 1  # the records with their images
    assert not any(out.get("output_type") == "error" for c in nb.cells for out in c.get("outputs", []))
    # the MLflow section read the project's store (kedro-mlflow made it during the data run), not a new one
    assert "No MLflow experiment" not in text
    assert not (data_project["path"] / "notebooks" / "mlflow.db").exists()


def _smoke_project(request) -> Path:
    """A project where a smoke run has finished: $LYCHEE_SMOKE_PROJECT, or a session-scoped `smoke_project`
    fixture when tests/conftest.py provides one (the end-to-end test's); otherwise the test is skipped."""
    if os.environ.get("LYCHEE_SMOKE_PROJECT"):
        return Path(os.environ["LYCHEE_SMOKE_PROJECT"]).resolve()
    try:
        return Path(request.getfixturevalue("smoke_project"))
    except pytest.FixtureLookupError:
        pytest.skip("no smoke-run project: set LYCHEE_SMOKE_PROJECT or provide a session `smoke_project` fixture")


def test_notebook_shows_the_results_of_a_smoke_run(request, monkeypatch):
    project = _smoke_project(request)
    if not (project / "data" / "08_reporting" / "evaluation_metrics.json").is_file():
        pytest.skip(f"{project} has no evaluation output")
    nb, text = _execute(project, monkeypatch)
    assert "No evaluation output yet" not in text
    assert "mrr_at_10" in text and "loss_curves.png" in text
    assert _images(nb) >= 4  # records, loss/metric bars, task types, the saved plots
