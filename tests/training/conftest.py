"""A small learnable model-input table (contract schema) with real PNG images, for training tests; and the
uninterrupted stage run that the resume tests compare against, run once per session."""

from __future__ import annotations

import pytest
from worker_stages import RESUME, worker_plan, write_large_image_table

from lychee_pipeline.training.synthetic import write_colour_item_table

# Variables a test's stage must not inherit from the caller's environment (fault injection, an MLflow store).
STAGE_ENV = ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI")


@pytest.fixture(scope="session")
def training_table_path(tmp_path_factory) -> str:
    return str(write_colour_item_table(tmp_path_factory.mktemp("train_data")))


@pytest.fixture(scope="session")
def large_image_table(tmp_path_factory) -> str:
    """The colour/item table with 168x168 images (worker_stages.write_large_image_table)."""
    return write_large_image_table(tmp_path_factory.mktemp("worker_data"))


@pytest.fixture
def traced(monkeypatch):
    """No inherited fault or MLflow store; the stage records which records each step saw (records_seen)."""
    for name in STAGE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LYCHEE_TRACE_RECORDS", "1")


@pytest.fixture(scope="session")
def uninterrupted_reference(tmp_path_factory, large_image_table) -> dict:
    """{"plan", "result"}: worker_plan(**RESUME) run to the end on 1 process without workers, traced. What a stage
    killed and resumed on that plan must reproduce (the resume tests of test_stage_processes.py and
    test_dataloader_workers.py), and the finished stage the gate test alters: one launch for the three.
    Shared: a test that changes the result changes a copy."""
    from lychee_pipeline.pipelines.training.nodes import run_training_stage

    tmp = tmp_path_factory.mktemp("uninterrupted_reference")
    plan = worker_plan(tmp, workers=0, **RESUME)
    with pytest.MonkeyPatch.context() as mp:
        for name in STAGE_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("LYCHEE_TRACE_RECORDS", "1")
        return {"plan": plan, "result": run_training_stage(large_image_table, plan, devices=1, final=True)}
