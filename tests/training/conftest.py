"""A small learnable model-input table (contract schema) with real PNG images, for training tests; and the stage
runs that tests of several files read, each launched once per session."""

from __future__ import annotations

import pytest
from stage_plans import RESUME, epoch_plan, worker_plan, write_large_image_table

from lychee_pipeline.training.synthetic import write_colour_item_table

# Variables a test's stage must not inherit from the caller's environment (fault injection, an MLflow store).
STAGE_ENV = ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI")


@pytest.fixture(scope="session")
def training_table_path(tmp_path_factory) -> str:
    return str(write_colour_item_table(tmp_path_factory.mktemp("train_data")))


@pytest.fixture(scope="session")
def large_image_table(tmp_path_factory) -> str:
    """The colour/item table with 168x168 images (stage_plans.write_large_image_table)."""
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


@pytest.fixture(scope="session")
def two_process_epoch(tmp_path_factory, training_table_path) -> dict:
    """{"plan", "result"}: epoch_plan(gpus=2) on the training table, 2 CPU processes, traced (12 steps). Read by
    test_stage_processes.py (the replicas stay in sync) and by the 2-process case of
    test_training_correctness.py's learning-rate test: one launch for both."""
    from lychee_pipeline.pipelines.training.nodes import run_training_stage

    plan = epoch_plan(tmp_path_factory.mktemp("two_process_epoch"), gpus=2)
    with pytest.MonkeyPatch.context() as mp:
        for name in STAGE_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("LYCHEE_TRACE_RECORDS", "1")
        return {"plan": plan, "result": run_training_stage(training_table_path, plan, devices=2, final=True)}
