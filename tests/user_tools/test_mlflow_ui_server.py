"""The MLflow UI's server, started as a user starts it, shows the project's runs and metrics.

The store is the one a user gets: ``kedro run --pipeline data`` in a project copy writes its parent run
through kedro-mlflow into ``<project>/mlflow.db``. Two more small runs are logged the way a smoke run
logs them (the project's ``StageTracker`` for the nested stage run, the reporting node
``log_run_to_mlflow`` for the parent's metrics) with different ``max_steps``, so there is something
to compare. Then ``mlflow server`` runs on 127.0.0.1 and its REST API (what the UI reads) is queried.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import mlflow
import pytest

from lychee_pipeline.pipelines.reporting.nodes import log_run_to_mlflow
from lychee_pipeline.tracking import ENV_EXPERIMENT, ENV_PARENT_RUN, StageTracker, flatten
from project_runs import mlflow_tracking_restored
from user_tools_support import user_env

EXPERIMENT = "lychee_pipeline"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, path: str, **query) -> dict:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _log_smoke_like_run(max_steps: int, data_counts: dict, monkeypatch, uri: str) -> tuple[str, str]:
    """A parent run + nested stage run shaped like `kedro run --pipeline smoke` logs them."""
    experiment_id = mlflow.set_experiment(EXPERIMENT).experiment_id
    params = {"smoke": {"run_name": "smoke", "training": {"max_steps": max_steps, "learning_rate": 2e-3}},
              "model": {"name_or_path": "builtin:tiny", "finetune": "full"}, "gpus": 1}
    with mlflow.start_run(run_name=f"smoke-{max_steps}") as parent:
        mlflow.log_params(flatten(params))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv(ENV_PARENT_RUN, parent.info.run_id)
        monkeypatch.setenv(ENV_EXPERIMENT, experiment_id)
        stage = StageTracker(True, "stage_1cpu_final", tags={"stage": "stage_1cpu_final"})
        assert stage.active, stage.failures
        stage.log_params({"training": {"max_steps": max_steps}, "devices": 1})
        for step in range(1, max_steps // 10 + 1):
            stage.log_metrics({"loss": 0.7 * math.exp(-step / max_steps * 5), "pairs_per_s": 50.0 + step}, step=step)
        stage.end()
        assert not stage.failures
        finetuned = 0.3 + max_steps / 1000
        metrics = {"test.mrr_at_10.base": 0.27, "test.mrr_at_10.finetuned": finetuned,
                   "test.mrr_at_10.diff": finetuned - 0.27, "business.expected_ctr_at_10.base": 0.57,
                   "business.expected_ctr_at_10.finetuned": 0.6 + max_steps / 1000}
        logged = log_run_to_mlflow(metrics, data_counts, [], params["model"])
        assert logged["metrics"] == len(metrics) + len(data_counts) and not logged["failures"]
    return parent.info.run_id, stage.run_id


@pytest.fixture
def tracking_store(data_project, monkeypatch):
    project: Path = data_project["path"]
    db = project / "mlflow.db"
    assert db.is_file(), "kedro-mlflow did not create mlflow.db in the project root"
    uri = f"sqlite:///{db}"
    monkeypatch.chdir(project)  # artifacts of new runs go to <project>/mlruns, as in a user's run
    # the runs below set MLFLOW_TRACKING_URI through monkeypatch, which puts back the value it first saw: the one
    # from before this fixture, saved here, not the store's that MLflow writes in the block
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with mlflow_tracking_restored():
        mlflow.set_tracking_uri(uri)
        counts = json.loads((project / "data" / "05_model_input" / "data_counts.json").read_text())
        runs = {steps: _log_smoke_like_run(steps, counts, monkeypatch, uri) for steps in (300, 100)}
    return {"project": project, "uri": uri, "runs": runs}


@pytest.fixture
def mlflow_server(tracking_store):
    port = _free_port()
    log = open(tracking_store["project"] / "mlflow_server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_store["uri"],
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=tracking_store["project"], env=user_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"mlflow server did not come up:\n{(tracking_store['project'] / 'mlflow_server.log').read_text()[-4000:]}")
            time.sleep(0.5)
        yield {"base": base, "proc": proc, **tracking_store}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # by its pid; it stops its workers itself
        try:
            proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the server's own session, started above
            proc.wait(timeout=10)
        log.close()


def test_mlflow_server_lists_runs_params_and_metrics(mlflow_server):
    base = mlflow_server["base"]
    experiment = _get(base, "/api/2.0/mlflow/experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]
    found = _post(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment["experiment_id"]],
                                                         "max_results": 100})["runs"]
    runs = {r["info"]["run_id"]: r for r in found}
    metrics = {rid: {m["key"]: m["value"] for m in r["data"].get("metrics", [])} for rid, r in runs.items()}
    params = {rid: {p["key"]: p["value"] for p in r["data"].get("params", [])} for rid, r in runs.items()}
    tags = {rid: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for rid, r in runs.items()}

    # the run kedro-mlflow wrote for `kedro run --pipeline data`: a parent run, parameters flattened with "."
    kedro_runs = [rid for rid, t in tags.items() if t.get("pipeline_names") == "data"
                  or "data" in t.get("kedro_command", "")]
    assert kedro_runs, sorted(tags)
    kedro_params = params[kedro_runs[0]]
    assert kedro_params["data_processing.split.seed"] == "42" and kedro_params["demo_data.n_records"] == "400"
    assert "data_processing.split.ratios.train" in kedro_params

    # the two smoke-like runs: parents with comparable figures, children with per-step curves
    (p300, s300), (p100, s100) = mlflow_server["runs"][300], mlflow_server["runs"][100]
    assert {p300, s300, p100, s100} <= set(runs)
    for parent, child, steps in ((p300, s300, 300), (p100, s100, 100)):
        assert runs[parent]["info"]["status"] == "FINISHED" and runs[child]["info"]["status"] == "FINISHED"
        assert tags[child]["mlflow.parentRunId"] == parent and "mlflow.parentRunId" not in tags[parent]
        assert params[parent]["smoke.training.max_steps"] == str(steps)
        assert {"test.mrr_at_10.base", "test.mrr_at_10.finetuned", "business.expected_ctr_at_10.finetuned",
                "data.lines_in", "data.train_size"} <= set(metrics[parent])
        assert metrics[parent]["data.lines_in"] == 400
        history = _get(base, "/api/2.0/mlflow/metrics/get-history", run_id=child, metric_key="loss")["metrics"]
        assert [m["step"] for m in sorted(history, key=lambda m: m["step"])] == list(range(1, steps // 10 + 1))
        assert {"loss", "pairs_per_s"} <= set(metrics[child])
    assert metrics[p300]["test.mrr_at_10.finetuned"] > metrics[p100]["test.mrr_at_10.finetuned"]

    # the web app itself is served (what `kedro mlflow ui` opens)
    with urllib.request.urlopen(f"{base}/", timeout=10) as r:
        page = r.read().decode()
    assert r.status == 200 and "<html" in page.lower()

    # stopped by its pid, as a user's Ctrl-C would: SIGTERM, then it exits and the port is free
    proc = mlflow_server["proc"]
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=45)
    print(f"mlflow server stopped {time.monotonic() - start:.1f} s after SIGTERM (rc {proc.returncode})")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{base}/health", timeout=2)


def test_the_readme_address_opens_the_training_runs(mlflow_server):
    """MLflow 3.17's UI picks an experiment's view from the address's `workflowType` parameter, else from a
    browser setting that starts as "genai" (Traces, Judges, ...); the experiment tag `mlflow.experimentKind`
    is no longer read. The README's address names the project's experiment and asks for the training view."""
    import re

    base = mlflow_server["base"]
    experiment = _get(base, "/api/2.0/mlflow/experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    addresses = re.findall(r"http://127\.0\.0\.1:5000/#/experiments/(\w+)/runs\?workflowType=(\w+)", readme)
    assert addresses, "the README gives no address of the training runs"
    assert set(addresses) == {(experiment["experiment_id"], "machine_learning")}, addresses
    # the tag stays for the MLflow versions that read it (set by MlflowStoreHooks in the data run)
    tags = {t["key"]: t["value"] for t in experiment.get("tags", [])}
    assert tags.get("mlflow.experimentKind") == "custom_model_development", tags

    # the UI this server sends reads the view from the address: the parameter and its two values are in it
    with urllib.request.urlopen(f"{base}/", timeout=10) as r:
        page = r.read().decode()
    scripts = re.findall(r'src="([^"]*static/js/main\.[0-9a-f]+\.js)"', page)
    assert scripts, page[:2000]
    with urllib.request.urlopen(urllib.parse.urljoin(f"{base}/", scripts[0]), timeout=30) as r:
        app = r.read().decode("utf-8", "replace")
    assert 'get("workflowType")' in app and 'MACHINE_LEARNING="machine_learning"' in app
    assert 'key:"mlflow.workflowType"' in app and 'GENAI="genai"' in app  # the browser setting and its default

