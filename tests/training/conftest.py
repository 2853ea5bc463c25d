"""A small learnable model-input table (contract schema) with real PNG images, for training tests; and the stage
runs that tests of several files read, each launched once per session."""

from __future__ import annotations

import pytest
from stage_plans import ACCUMULATION, RESUME, epoch_plan, worker_plan, write_large_image_table

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


def _traced_run(table: str, plan: dict, devices: int) -> dict:
    """{"plan", "result"}: the stage of `plan` run to the end with the `traced` environment (a session fixture
    cannot use the function-scoped one)."""
    from lychee_pipeline.training.planning import run_training_stage

    with pytest.MonkeyPatch.context() as mp:
        for name in STAGE_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("LYCHEE_TRACE_RECORDS", "1")
        return {"plan": plan, "result": run_training_stage(table, plan, devices=devices, final=True)}


# Stage runs that tests of several files read, each launched once per session. A test that changes a result
# changes a copy.

@pytest.fixture(scope="session")
def uninterrupted_reference(tmp_path_factory, large_image_table) -> dict:
    """worker_plan(**RESUME) on 1 process without workers: what a stage killed and resumed on that plan must
    reproduce (the resume tests of test_stage_processes.py and test_dataloader_workers.py), and the finished
    stage the gate test of test_training_correctness.py alters."""
    plan = worker_plan(tmp_path_factory.mktemp("uninterrupted_reference"), workers=0, **RESUME)
    return _traced_run(large_image_table, plan, devices=1)


@pytest.fixture(scope="session")
def two_process_epoch(tmp_path_factory, training_table_path) -> dict:
    """epoch_plan(gpus=2) on the training table: 12 steps on 2 CPU processes. Read by test_stage_processes.py
    (the replicas stay in sync) and the 2-process case of test_training_correctness.py's learning-rate test."""
    plan = epoch_plan(tmp_path_factory.mktemp("two_process_epoch"), gpus=2)
    return _traced_run(training_table_path, plan, devices=2)


@pytest.fixture(scope="session")
def two_process_accumulation(tmp_path_factory, large_image_table) -> dict:
    """worker_plan(**ACCUMULATION) without workers: one epoch in 6 optimizer steps of 2 micro-batches on 2 CPU
    processes, with the resolution ramp. The in-process collation test_dataloader_workers.py compares its
    workers against, and the accumulation case of test_training_correctness.py's learning-rate test."""
    plan = worker_plan(tmp_path_factory.mktemp("two_process_accumulation"), workers=0, **ACCUMULATION)
    return _traced_run(large_image_table, plan, devices=2)
