"""Helpers of the ship tests: a mixed-modality candidate set, test rows whose labels a given model wins,
and one `full` run's tail (evaluation scoring, MLflow model logging, the registry node) done for real."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from project_runs import mlflow_tracking_restored
from stage_results import make_result

N_QUERIES = 24
WORDS = ["red", "blue", "green", "silk", "cotton", "leather", "dress", "shoes", "bag", "scarf", "coat", "hat"]

#: Evaluation parameters of the ship tests (fewer resamples: fast, still a real paired test).
EVALUATION = {"seed": 0, "reranker": {"batch_size": 16, "device": "cpu"}, "instructions": None,
              "significance": {"n_resamples": 2000, "confidence_level": 0.95}}
REGISTRY = {"enabled": True, "model_name": "lychee-reranker", "alias": "champion",
            "gate": {"metric": "mrr_at_10", "alpha": 0.05, "min_improvement": 0.0}}
TRAINING = {"max_length": 3200, "min_pixels": 3136, "max_pixels": 12544, "loss": "pointwise", "group_size": 4}
DATA_PROCESSING = {"split": {"method": "hash", "seed": 42, "ratios": {"train": 0.8, "val": 0.1, "test": 0.1}}}


@contextmanager
def mlflow_store(root: Path):
    """The global MLflow tracking URI and the working folder pointed at `root` (store and artifacts), restored after."""
    import mlflow

    previous_cwd = os.getcwd()
    with mlflow_tracking_restored():
        os.chdir(root)
        mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
        try:
            mlflow.set_experiment("lychee_pipeline")
            yield
        finally:
            while mlflow.active_run() is not None:
                mlflow.end_run()
            os.chdir(previous_cwd)


def candidate_queries(images: Path) -> list[dict[str, Any]]:
    """24 queries of 4 candidates each, every modality mix: text, image and text+image on both sides."""
    out = []
    for q in range(N_QUERIES):
        word = lambda k: WORDS[(q * 5 + k) % len(WORDS)]  # noqa: E731
        image = lambda k: str(images / f"img{(q + k) % 6}.png")  # noqa: E731
        query = [{"text": f"{word(0)} {word(1)}", "image": None}, {"text": f"{word(2)} {word(3)} for women", "image": None},
                 {"text": None, "image": image(0)}, {"text": f"like this {word(4)}", "image": image(1)}][q % 4]
        docs = [{"text": f"a {word(1)} {word(6)} in stock", "image": None},
                {"text": None, "image": image(2)},
                {"text": f"{word(3)} {word(7)} with pictures", "image": image(3)},
                {"text": f"{word(8)} {word(9)} {word(10)}", "image": None}]
        out.append({"query_id": f"q{q}", "query": query,
                    "docs": [{"doc_id": f"q{q}-d{k}", **d} for k, d in enumerate(docs)]})
    return out


def make_test_records(queries: list[dict[str, Any]], winner_scores: list[float]) -> list[dict[str, Any]]:
    """Model-input rows: each query's positive is the document `winner_scores` ranks first."""
    rows, it = [], iter(winner_scores)
    for q in queries:
        scores = [next(it) for _ in q["docs"]]
        best = int(np.argmax(scores))
        docs = [{"doc_id": d["doc_id"], "text": d["text"], "image": d["image"], "meta": "{}"} for d in q["docs"]]
        rows.append({
            "record_id": q["query_id"], "query": q["query"],
            "positives": [docs[best]],
            "negatives": [{**d, "hard": True} for k, d in enumerate(docs) if k != best],
            # No task type: every pair's instruction follows its own modalities, as in `score_pairs` above and
            # in a request without a task_type column (a record's task type would give all its pairs one).
            "task_type": None, "language": "en", "split": "test",
        })
    return rows


def score_pairs(model_dir: str, queries: list[dict[str, Any]]) -> list[float]:
    from lychee_pipeline.reranker import Reranker

    reranker = Reranker.from_pretrained(model_dir, device="cpu", batch_size=16)
    return reranker.score_pairs([(q["query"], {"text": d["text"], "image": d["image"]}) for q in queries
                                 for d in q["docs"]])


def register_run(records: list[dict[str, Any]], new_model: str, base_model: str, image_root: Path,
                 stage: str = "stage_1cpu_final", name: str = "lychee-reranker") -> tuple[dict[str, Any], Any]:
    """One `full` run's tail, for real: the evaluation scores base and new model on `records`, the new model is
    logged to a new MLflow run (with the serving config of the reporting step), then the registry node runs.
    Returns (outcome, test_scores). Uses the global MLflow tracking URI."""
    import mlflow

    from lychee_pipeline.pipelines.evaluation.nodes import score_test_set
    from lychee_pipeline.pipelines.registry.nodes import register_final_model
    from lychee_pipeline.pipelines.reporting.nodes import serving_config
    from lychee_pipeline.tracking import log_reranker_model

    stage_results = [make_result(stage=stage, devices=1, peak_mem_gib=[1.0], adapter_dir=new_model,
                                 final=True).model_dump()]
    scoring_dir = Path(new_model).parent / f"scoring_{Path(new_model).name}"  # this run's, not the repo's data/
    evaluation = {**EVALUATION, "score_cache": {"enabled": False}, "scoring": {"work_dir": str(scoring_dir)}}
    scores, _ = score_test_set(records, stage_results, {"name_or_path": base_model}, evaluation, 1, "cpu")
    serving = serving_config({"image_roots": [str(image_root)]}, EVALUATION, {"image_roots": None})
    with mlflow.start_run(run_name="ship-test"):
        uri = log_reranker_model(new_model, base_model, serving=serving)
        outcome, report = register_final_model(
            records, scores, stage_results, {"model_uri": uri, "failures": []},
            {"name_or_path": base_model, "finetune": "full"},
            {"lines_in": 30, "clean": 24, "test_size": len(records)},
            {"test.mrr_at_10.base": 0.5, "test.mrr_at_10.finetuned": 0.9},
            EVALUATION, TRAINING, DATA_PROCESSING, {**REGISTRY, "model_name": name},
        )
    assert outcome["status"] == "registered", outcome
    assert f"version {outcome['version']}" in report
    # the figures left off the version's tags are listed in the report (and are the run's own)
    assert outcome["details"] and all(f"| `{name}` |" in report for name in outcome["details"])
    return outcome, scores




# ---------------------------------------------------------------------------------------------- serving

#: a loaded CI machine; the measured startup is printed (docs/serving.md quotes it)
SERVE_STARTUP_LIMIT_S = 180


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_invocations(base: str, body: dict) -> tuple[int, dict]:
    """POST `body` to the server's /invocations; (HTTP status, the JSON answer)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@contextmanager
def served_model(root: Path, tracking_uri: str, model_uri: str, log_path: Path):
    """`mlflow models serve -m <model_uri> --env-manager local` started as a user starts it, from `root`, on a free
    loopback port against `tracking_uri`; yields {"base", "startup_s", "pid"} once /ping answers, and stops the
    server by its PID (its process group: the server and its uvicorn worker) at the end, whatever happened."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    import pytest

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "LYCHEE_IMAGE_ROOTS"}
    env.update(MLFLOW_TRACKING_URI=tracking_uri, KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1",
               DO_NOT_TRACK="1", OMP_NUM_THREADS="1",
               # the server execs `uvicorn` from PATH: the environment's bin folder first, as when it is activated
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    port = free_port()
    with open(log_path, "w") as log:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.monotonic() - started > SERVE_STARTUP_LIMIT_S:
                pytest.fail(f"mlflow models serve did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        startup = time.monotonic() - started
        print(f"mlflow models serve ready after {startup:.1f} s")
        yield {"base": base, "startup_s": startup, "pid": proc.pid}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        assert proc.poll() is not None
