"""One project, one place (issue 19, points 2-4): `kedro run` from a subfolder works in the project root, a
copied project writes only inside itself, and `--params` keys the pipeline does not read are named.

Real `kedro run` processes (the CLI, as a user types it) with the default parameters: the session's smoke run
(tests/conftest.py::smoke_run, started in notebooks/) and a second run in a copy of that project.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from project_runs import REPO, kedro_run


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _store(root: Path) -> tuple[list, list]:
    with sqlite3.connect(root / "mlflow.db") as conn:
        experiments = conn.execute("SELECT name, artifact_location FROM experiments").fetchall()
        runs = conn.execute("SELECT name, status, artifact_uri FROM runs").fetchall()
    return experiments, runs


@pytest.fixture(scope="module")
def project_a(smoke_run) -> dict:
    """`kedro run --pipelines smoke` started in notebooks/ of a fresh project copy (the session's smoke run)."""
    return smoke_run


def test_run_from_a_subfolder_writes_into_the_project_root(project_a):
    root, log = project_a["path"], project_a["log"]
    assert f"working in the project root {root}" in log
    assert sorted(p.name for p in (root / "notebooks").iterdir()) == ["01_explore_data_and_results.ipynb"]
    assert (root / "mlflow.db").is_file() and (root / "mlruns").is_dir() and (root / "info.log").is_file()
    assert (root / "data/01_raw/demo/records.jsonl").is_file()
    assert (root / "data/06_models/builtin_tiny").is_dir()
    assert (root / "data/06_models/runs/smoke/stage_1cpu_final/result.json").is_file()
    experiments, runs = _store(root)
    assert dict(experiments)["lychee_pipeline"] == (root / "mlruns").as_posix() + "/1"
    assert {name for name, status, _ in runs} >= {"smoke", "stage_1cpu_final"}
    assert all(status == "FINISHED" for _, status, _ in runs)
    assert all(uri.startswith((root / "mlruns").as_posix() + "/") for _, _, uri in runs)
    assert (root / "data/08_reporting/evaluation_report.md").is_file()


def test_stored_image_paths_are_relative_to_the_project_root(project_a):
    import pyarrow.parquet as pq

    root = project_a["path"]
    paths = pq.read_table(root / "data/02_intermediate/image_manifest.parquet").column("path").to_pylist()
    assert paths and all(p.startswith("data/01_raw/demo/images/") for p in paths), paths[:3]
    records = pq.read_table(root / "data/03_primary/normalized_records.parquet").to_pylist()
    images = [d["image"] for r in records for d in [r["query"], *r["positives"], *r["negatives"]] if d["image"]]
    assert images and not any(Path(p).is_absolute() for p in images)


def test_a_copied_project_writes_only_inside_itself(project_a, tmp_path):
    a = project_a["path"]
    b = tmp_path / "B"
    shutil.copytree(a, b, symlinks=True)  # as `cp -a` or a move: contents and mtimes
    before = _tree(a)
    log = kedro_run(b, "--pipelines", "smoke")
    assert _tree(a) == before, "the run in the copy changed files of the original"
    assert f"the MLflow store was copied from {a}" in log
    experiments, runs = _store(b)
    assert dict(experiments)["lychee_pipeline"] == (b / "mlruns").as_posix() + "/1"
    assert all(uri.startswith((b / "mlruns").as_posix() + "/") for _, _, uri in runs), runs
    assert len(runs) == 3  # 2 copied from A (parent, stage) and the new parent: the stage is reused
    # nothing is redone: the images and the finished stage of A are reused in B
    assert "0 to check" in log and "reusing the finished result" in log, log[-5000:]
    summary = json.loads((b / "data/08_reporting/run_summary.json").read_text())
    assert str(a) not in json.dumps(summary)


def test_relocation_leaves_a_chosen_artifact_location_alone(tmp_path):
    from lychee_pipeline.project import relocate_mlflow_store

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE experiments (experiment_id INTEGER, name TEXT, artifact_location TEXT)")
        conn.execute("CREATE TABLE runs (run_uuid TEXT, artifact_uri TEXT)")
        conn.execute("INSERT INTO experiments VALUES (1, 'lychee_pipeline', 's3://bucket/mlruns/1')")
        conn.execute("INSERT INTO experiments VALUES (2, 'other', '/old/clone/mlruns/2')")
    assert relocate_mlflow_store(f"sqlite:///{db}", "lychee_pipeline", tmp_path) is None
    assert relocate_mlflow_store(f"sqlite:///{db}", "other", tmp_path) == "/old/clone"
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT artifact_location FROM experiments ORDER BY experiment_id").fetchall() == [
            ("s3://bucket/mlruns/1",), (f"{tmp_path.resolve()}/mlruns/2",)]


def _params_and_pipelines():
    from kedro.config import OmegaConfigLoader
    from kedro.framework.project import pipelines
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(REPO)
    params = OmegaConfigLoader(str(REPO / "conf"), base_env="base", default_run_env="local")["parameters"]
    return params, pipelines


@pytest.mark.parametrize(
    ("pipeline", "key", "expected"),
    [
        ("smoke", "training.learning_rate",
         "--params training.learning_rate is not used by the smoke pipeline: smoke.training.learning_rate"),
        ("smoke", "training.max_steps", "set smoke.training.max_steps instead"),
        ("full", "smoke.training.max_steps", "--params smoke.training.max_steps is not read by the full pipeline"),
        ("evaluation", "stages.default_check_steps", "is not read by the evaluation pipeline"),  # it reads training (processing)
        ("full", "trainng.learning_rate", "trainng.learning_rate is not a parameter of this project"),
        ("data", "max_queries", "it reads evaluation.max_queries"),
    ],
)
def test_params_the_pipeline_does_not_read_are_named(pipeline, key, expected):
    from lychee_pipeline.hooks import unread_params

    params, pipelines = _params_and_pipelines()
    if pipeline == "data":  # a key only another pipeline reads: the message names where it lives
        pipeline = "full"
    messages = unread_params({key: 1}, params, pipelines[pipeline].inputs(), pipeline)
    assert len(messages) == 1 and expected in messages[0], messages


@pytest.mark.parametrize("key", ["training.learning_rate", "gpus", "evaluation.max_queries", "model.name_or_path"])
def test_params_the_full_pipeline_reads_give_no_warning(key):
    from lychee_pipeline.hooks import unread_params

    params, pipelines = _params_and_pipelines()
    assert unread_params({key: 1}, params, pipelines["full"].inputs(), "full") == []


def test_the_log_in_a_file_is_plain_short_and_free_of_library_notices(project_a):
    log = project_a["log"]
    lines = log.splitlines()
    after_start = lines[next(i for i, x in enumerate(lines) if "working in the project root" in x):]
    # whole lines, not Rich's 80-column layout: a long message stays on its line
    assert any("Pipeline execution completed successfully" in x and " INFO " in x for x in after_start)
    assert not [x for x in after_start if x.startswith(" " * 20)], "wrapped continuation lines in the file log"
    for notice in ("register_new_resolver", "is_gradient_checkpointing", "Loading weights"):
        assert notice not in log, notice
    # the launcher's progress lines (runtime/progress.py) stand for the ranks' step lines, kept in launch.log
    steps = [x for x in lines if "lychee_pipeline.runtime.progress" in x and "stage_1cpu_final: step " in x]
    assert 1 <= len(steps) <= 12, steps  # at most every tenth / 30 s and the last, not one line per step
    assert re.search(r"step (\d+)/\1 \(100%\)", steps[-1]), steps  # the last line: every step done
    assert not [x for x in lines if "] step " in x and " loss " in x], "the ranks' step lines relayed to the log"


def test_the_runner_says_once_which_node_completed():
    import logging

    from lychee_pipeline.hooks import RunnerEchoFilter

    echo, shown = RunnerEchoFilter(), []
    for msg, args in [("Using synchronous mode for loading and saving data. Use the --async flag ...", ()),
                      ("Running node: %s", ("run_stage: run_stage_slot([...]) -> [...]",)),
                      ("Completed node: %s", ("training.train_stage_1.run_stage",)),
                      ("Completed %d out of %d tasks", (5, 39)),
                      ("Completed %d out of %d tasks", (6, 39)),  # no node named before it: as it was
                      ("Pipeline execution completed successfully in %.1f sec.", (1.0,))]:
        record = logging.LogRecord("kedro.runner.sequential_runner", logging.INFO, "", 0, msg, args, None)
        if echo.filter(record):
            shown.append(record.getMessage())
    assert shown == ["Running node: run_stage: run_stage_slot([...]) -> [...]",
                     "Completed node: training.train_stage_1.run_stage (5 out of 39 tasks)",
                     "Completed 6 out of 39 tasks", "Pipeline execution completed successfully in 1.0 sec."]


@pytest.mark.parametrize("override", ["smoke.training.max_steps=3", "data_processing.normalization.min_negatives=0"])
def test_a_local_data_block_and_a_nested_param_keep_the_rest_of_the_block(tmp_path, override):
    """The README's first way to own data is a `data:` block in conf/local/parameters.yml. Beside it, a nested
    `--params` (parsed as the CLI parses it, loaded with the project's settings) changes one key and keeps its
    block's other keys: Kedro's default merge replaced the whole `smoke:` block and the run stopped on a missing
    params:smoke.sample_size."""
    from kedro.config import OmegaConfigLoader
    from kedro.framework.cli.utils import _split_params

    from lychee_pipeline import settings

    shutil.copytree(REPO / "conf" / "base", tmp_path / "base")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "parameters.yml").write_text("data:\n  raw_path: /data/shop/jsonl\n")
    runtime = _split_params(None, None, override)
    base = OmegaConfigLoader(str(tmp_path), **settings.CONFIG_LOADER_ARGS)["parameters"]
    params = OmegaConfigLoader(str(tmp_path), runtime_params=runtime, **settings.CONFIG_LOADER_ARGS)["parameters"]
    key, value = override.split("=")
    top, *path = key.split(".")
    expected = json.loads(json.dumps(base[top]))
    node = expected
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = int(value)
    assert params[top] == expected  # one key changed, every other key of the block kept
    assert params["data"]["raw_path"] == "/data/shop/jsonl" and params["data"]["image_roots"] == []
