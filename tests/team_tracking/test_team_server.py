"""A team's tracking server (issue 33): `kedro run --pipelines full --params gpus=2` in project copies logging to a
real `mlflow server` on PostgreSQL (tests/team_tracking/conftest.py), through the `kedro` CLI as a user runs it.

One sequence shares the server and as few runs as it can (the module fixture `team_runs`):
1. project A (the server's URI in MLFLOW_TRACKING_URI, with a password in it and one in the environment) starts
   `full`; when its first stage is launched the server dies (mlflow's process group killed): the run stops
   with one line naming the URI, the finished stage's result on disk;
2. the server is started again on the same store; A runs `full` again (its finished stage reused) while project
   B (the URI and credentials in conf/local/) runs `full` at the same time: both land complete, each
   registers a version.
The tests then read the server: runs, per-step metrics, artifacts in the server's artifact root, the registry,
the champion for `rerank` and `mlflow models serve`, and no password anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from team_support import clean_env, free_port
from project_runs import make_cli_project

pytestmark = pytest.mark.slow

URI_SECRET = "uri-Pa55-7e4m"      # in project A's MLFLOW_TRACKING_URI
ENV_SECRET = "env-Pa55-9q2x"      # project A's MLFLOW_TRACKING_PASSWORD
CONF_SECRET = "conf-Pa55-3k8w"    # project B's conf/local/credentials.yml
SECRETS = (URI_SECRET, ENV_SECRET, CONF_SECRET)
MODEL = "lychee-reranker"
# small and fast, as the other end-to-end tests: a 400-record demo catalogue, tiny stages (conf/local/ is merged
# into conf/base/ key by key)
SMALL_RUN = """\
demo_data: {n_products: 80, n_records: 400}
data_processing: {ingestion: {workers: 1}, image_check: {workers: 1}}
model: {finetune: full}
stages: {check_steps: {1: 8}}
training: {max_steps: 6, learning_rate: 2.0e-3, checkpoint_every: 100, max_pixels: 12544}
evaluation: {max_queries: 20}
"""
RUN_LIMIT_S = 900


def _project(root: Path, conf_local: dict[str, str]) -> Path:
    project = make_cli_project(root)
    (project / "conf" / "local").mkdir(exist_ok=True)
    (project / "conf" / "local" / "parameters.yml").write_text(SMALL_RUN)
    for name, text in conf_local.items():
        (project / "conf" / "local" / name).write_text(text)
    return project


class KedroRun:
    """`kedro run ARGS` in a child process, its output in a file."""

    def __init__(self, project: Path, args: list[str], env: dict[str, str], log: Path):
        self.project, self.log = project, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kedro", "run", *args], cwd=project, env=env,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        return self.proc.returncode, self.log.read_text(errors="replace")


def _env_a(server) -> dict[str, str]:
    return clean_env(MLFLOW_TRACKING_URI=f"http://lychee:{URI_SECRET}@127.0.0.1:{server.port}",
                     MLFLOW_TRACKING_USERNAME="lychee", MLFLOW_TRACKING_PASSWORD=ENV_SECRET)


def _assert_ok(rc: int, log: str, what: str) -> None:
    assert rc == 0, f"{what} failed ({rc}):\n{log[-6000:]}"


@pytest.fixture(scope="module")
def team_runs(tracking_server, tmp_path_factory):
    server = tracking_server
    base = tmp_path_factory.mktemp("team_runs")
    project_a = _project(base / "a", {})
    project_b = _project(base / "b", {
        "mlflow.yml": f"server:\n  mlflow_tracking_uri: {server.uri}\n  credentials: team_mlflow\n",
        "credentials.yml": f"team_mlflow:\n  MLFLOW_TRACKING_USERNAME: lychee\n  MLFLOW_TRACKING_PASSWORD: {CONF_SECRET}\n",
    })
    timings = {}

    # 1. the server dies while A's first stage runs
    started = time.monotonic()
    first = KedroRun(project_a, ["--pipelines", "full", "--params", "gpus=2"], _env_a(server), base / "a_first.log")
    while not list(project_a.glob("data/06_models/runs/*/stage_1cpu/launch.log")):
        if first.proc.poll() is not None or time.monotonic() - started > RUN_LIMIT_S:
            pytest.fail(f"project A's first stage never started:\n{first.log.read_text()[-6000:]}")
        time.sleep(0.2)
    server.kill_mlflow()
    interrupted = first.wait()
    timings["first_run_s"] = time.monotonic() - started
    stages_after_first = sorted(p.name for p in project_a.glob("data/06_models/runs/*/stage_*") if p.is_dir())
    found = list(project_a.glob("data/06_models/runs/*/stage_1cpu/result.json"))
    first_result = json.loads(found[0].read_text()) if found else None

    # 2. the server again, on the same store; A again and B at once
    started = time.monotonic()
    server.start()
    timings["restart_s"] = time.monotonic() - started
    started = time.monotonic()
    rerun = KedroRun(project_a, ["--pipelines", "full", "--params", "gpus=2"], _env_a(server), base / "a_rerun.log")
    other = KedroRun(project_b, ["--pipelines", "full", "--params", "gpus=2"], clean_env(), base / "b.log")
    results = {"rerun": rerun.wait(), "other": other.wait()}
    timings["two_runs_s"] = time.monotonic() - started
    print(f"team runs: {timings}; server starts {[round(s, 1) for s in server.starts]} s")
    return {"server": server, "a": project_a, "b": project_b, "interrupted": interrupted, **results,
            "stages_after_first": stages_after_first, "first_result": first_result,
            "logs": [first.log, rerun.log, other.log], "base": base}


def _client(server):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)


def test_unreachable_server_is_refused_before_any_data_work(tmp_path):
    project = _project(tmp_path / "p", {})
    port = free_port()  # nothing listens there
    env = clean_env(MLFLOW_TRACKING_URI=f"http://lychee:{URI_SECRET}@127.0.0.1:{port}")
    proc = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "full", "--params", "gpus=2"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line.strip() for line in out.splitlines() if "TrackingServerUnavailable: " in line]
    assert lines and lines[-1].startswith("TrackingServerUnavailable: MLflow tracking "
                                          f"server http://lychee:***@127.0.0.1:{port} does not answer"), out[-3000:]
    assert "nothing was run" in lines[-1] and "make tracking-server" in lines[-1]
    assert URI_SECRET not in out
    # before any data work, and no local store made instead
    assert not [p for p in (project / "data").rglob("*") if p.is_file()], "data was written"
    assert not (project / "mlflow.db").exists() and not (project / "mlruns").exists()
    assert "Running node" not in out


def test_server_gone_mid_run_stops_in_one_line_and_keeps_the_stage(team_runs):
    rc, log = team_runs["interrupted"]
    port = team_runs["server"].port
    assert rc != 0, log[-4000:]
    # a refusal: its one line is the last on the terminal, the traceback went to info.log
    line = log.strip().splitlines()[-1]
    assert line.startswith(f"Error: MLflow tracking server http://lychee:***@127.0.0.1:{port} does not answer"), \
        log[-6000:]
    assert "the stage stage_1cpu finished and its result is on disk in" in line and "finished stages are reused" in line
    result = team_runs["first_result"]  # stage_1cpu/result.json as the interrupted run left it
    assert result is not None and result["steps"] == 8 and result["tracking_failures"]
    assert team_runs["stages_after_first"] == ["stage_1cpu"]  # stopped before the next stage
    # the hooks' goodbyes to the dead server did not bury that line under tracebacks
    assert log.count("Traceback (most recent call last)") == 0, log[-6000:]


def test_rerun_reuses_the_stage_and_two_runs_at_once_land_complete(team_runs):
    for key in ("rerun", "other"):
        _assert_ok(*team_runs[key], key)
    rerun_log = team_runs["rerun"][1]
    assert "stage stage_1cpu: reusing the finished result" in rerun_log
    assert "stage stage_2cpu_final: 2 CPU process(es)" in rerun_log  # the one that had not run was launched
    assert "stage stage_1cpu: 1 CPU process(es)" in team_runs["other"][1]  # B trained both

    client = _client(team_runs["server"])
    experiment = client.get_experiment_by_name("lychee_pipeline")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    by_id = {r.info.run_id: r for r in runs}
    for project, expected_stages in ((team_runs["a"], {"stage_2cpu_final"}),
                                     (team_runs["b"], {"stage_1cpu", "stage_2cpu_final"})):
        outcome = json.loads((project / "data/08_reporting/registry_outcome.json").read_text())
        assert outcome["status"] == "registered", outcome
        version = client.get_model_version(MODEL, str(outcome["version"]))
        parent = by_id[version.run_id]
        assert parent.info.status == "FINISHED" and "mlflow.parentRunId" not in parent.data.tags
        assert parent.data.params["gpus"] == "2" and parent.data.params["training.max_steps"] == "6"
        assert parent.data.metrics["data.lines_in"] == 400 and "test.mrr_at_10.finetuned" in parent.data.metrics
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert {c.data.tags["stage"] for c in children} == expected_stages
        assert all(c.info.status == "FINISHED" for c in children)
        final = next(c for c in children if c.data.tags["stage"] == "stage_2cpu_final")
        # per-step metrics from rank 0 of the stage processes, through the server
        assert [m.step for m in client.get_metric_history(final.info.run_id, "loss")] == list(range(1, 7))
        # the gate's decision on the version, the alias where it promoted
        assert version.description.startswith(outcome["reason"]) and version.tags["gate.decision"]
        assert ("champion" in version.aliases) == outcome["promoted"]
        # nothing was written to a local store instead
        assert not (project / "mlflow.db").exists() and not (project / "mlruns").exists()
    versions = client.search_model_versions(f"name='{MODEL}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]  # registered at once, numbered apart


def test_artifacts_are_uploaded_through_the_server(team_runs):
    server, client = team_runs["server"], _client(team_runs["server"])
    artifact_root = server.root / "server" / "artifacts"
    outcome = json.loads((team_runs["b"] / "data/08_reporting/registry_outcome.json").read_text())
    version = client.get_model_version(MODEL, str(outcome["version"]))
    parent = client.get_run(version.run_id)
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:/")  # proxied: clients never see the folder
    stored = artifact_root / parent.info.artifact_uri.removeprefix("mlflow-artifacts:/")
    assert (stored / "reporting" / "evaluation_report.md").is_file()
    assert {"reporting/evaluation_report.md", "reporting/plots"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "reporting")}
    stage = client.search_runs([parent.info.experiment_id],
                               filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                             "and tags.stage = 'stage_2cpu_final'")[0]
    assert [a.path for a in client.list_artifacts(stage.info.run_id, "adapter")]
    # the logged model (MLflow 3: a logged model of the run) lies in the server's artifact root too
    model_id = json.loads((team_runs["b"] / "data/08_reporting/mlflow_logging.json").read_text())["model_uri"]
    assert list(artifact_root.rglob(f"models/{model_id.removeprefix('models:/')}/artifacts/MLmodel"))


def test_no_password_in_logs_params_or_tags(team_runs):
    client = _client(team_runs["server"])
    texts = [path.read_text(errors="replace") for path in team_runs["logs"]]
    for project in (team_runs["a"], team_runs["b"]):
        texts += [p.read_text(errors="replace") for p in project.rglob("*")
                  if p.is_file() and p.suffix in (".log", ".json", ".md", ".txt", ".yaml") and "conf" not in p.parts]
    experiment = client.get_experiment_by_name("lychee_pipeline")
    for run in client.search_runs([experiment.experiment_id], max_results=100):
        texts += [f"{k}={v}" for k, v in {**run.data.params, **run.data.tags}.items()]
    for version in client.search_model_versions(f"name='{MODEL}'"):
        texts += [f"{k}={v}" for k, v in version.tags.items()]
    assert len(texts) > 100
    leaks = [(secret, text[max(0, text.find(secret) - 200):text.find(secret) + 50])
             for text in texts for secret in SECRETS if secret in text]
    assert not leaks, leaks[:3]
    assert "lychee:***@127.0.0.1" in team_runs["interrupted"][1]  # the URI is named, masked


def _post(base: str, body: dict) -> dict:
    request = urllib.request.Request(f"{base}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_rerank_and_serving_read_the_champion_from_the_server(team_runs, tmp_path):
    server, client = team_runs["server"], _client(team_runs["server"])
    champion = [v for v in client.search_model_versions(f"name='{MODEL}'") if "champion" in v.aliases]
    if not champion:  # tiny runs on a 20-query split: the gate may promote neither (its own tests cover it)
        client.set_registered_model_alias(MODEL, "champion", "2")
    candidates = tmp_path / "candidates.jsonl"
    pairs = [("red dress", "a red cotton dress"), ("red dress", "blue leather shoes"), ("red dress", "a red skirt")]
    candidates.write_text(json.dumps({"id": "q1", "query": "red dress",
                                      "docs": [{"id": f"d{i}", "text": doc} for i, (_, doc) in enumerate(pairs)]}) + "\n")
    # project B: the server named in its conf/local/mlflow.yml
    run = KedroRun(team_runs["b"], ["--pipelines", "rerank", "--params",
                                    f"rerank.input={candidates},rerank.model=models:/{MODEL}@champion"],
                   clean_env(), tmp_path / "rerank.log")
    _assert_ok(*run.wait(), "rerank")
    result = json.loads((team_runs["b"] / "data/07_model_output/rerank_results.jsonl").read_text().splitlines()[0])
    ranked = {d["doc_id"]: d["score"] for d in result["ranked"]}
    assert set(ranked) == {"d0", "d1", "d2"}
    summary = json.loads((team_runs["b"] / "data/08_reporting/rerank_summary.json").read_text())
    assert (summary["model_name"], summary["model_alias"]) == (MODEL, "champion")

    port = free_port()
    env = clean_env(MLFLOW_TRACKING_URI=server.uri, OMP_NUM_THREADS="1",
                    PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{MODEL}@champion",
             "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.monotonic() - started > 240:
                pytest.fail(f"mlflow models serve did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.3)
        rows = [{"query_text": q, "query_image": "", "doc_text": d, "doc_image": ""} for q, d in pairs]
        served = _post(base, {"dataframe_records": rows})["predictions"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker: one process group
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    # the served champion and the rerank pipeline read the same model from the server
    assert served == pytest.approx([ranked[f"d{i}"] for i in range(len(pairs))], abs=1e-5)
