"""End to end, as a user runs it: `smoke` through the `kedro` CLI (tests/conftest.py::smoke_run) and `full` through
KedroSession, each in a copy of the project, with the real `accelerate launch` processes and a real sqlite MLflow
store, checked through MlflowClient."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from project_runs import make_project_copy, run_kedro


def _client(root: Path):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    return mlflow.MlflowClient()


def _runs(root: Path):
    client = _client(root)
    experiment = client.get_experiment_by_name("lychee_pipeline")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def test_smoke_trains_and_beats_the_untrained_model(smoke_project):
    metrics = json.loads((smoke_project / "data/08_reporting/evaluation_mlflow_metrics.json").read_text())
    base, tuned = metrics["test.mrr_at_10.base"], metrics["test.mrr_at_10.finetuned"]
    assert tuned > base + 0.1, f"fine-tuned MRR@10 {tuned:.3f} does not beat base {base:.3f} by 0.1"
    stages = json.loads((smoke_project / "data/06_models/stage_results/all_stages.json").read_text())
    assert [s["stage"] for s in stages] == ["stage_1cpu_final"] and stages[0]["steps"] == 300
    summary = json.loads((smoke_project / "data/08_reporting/run_summary.json").read_text())
    assert summary["lines_in"] == 2400 and summary["mrr_at_10_finetuned"] == pytest.approx(tuned)
    # every line accounted for: records + rejected + duplicate lines, then normalized + quarantined records
    assert summary["lines_in"] == summary["records_in"] + summary["rejected"] + summary["duplicates"]
    assert summary["records_in"] == summary["records_normalized"] + summary["quarantined"]
    for plot in (smoke_project / "data/08_reporting").rglob("*.png"):
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_is_tracked_in_mlflow(smoke_project):
    import mlflow
    import pandas as pd

    client, parents, children = _runs(smoke_project)
    assert len(parents) == 1 and len(children) == 1
    parent, stage = parents[0], children[0]
    assert stage.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.params["training.loss"] == "pointwise"  # parameters flattened
    assert parent.data.metrics["test.mrr_at_10.finetuned"] > parent.data.metrics["test.mrr_at_10.base"]
    assert parent.data.metrics["data.lines_in"] == 2400
    history = client.get_metric_history(stage.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 301))
    assert {"pairs_per_s", "tokens_per_s", "peak_mem_gib", "learning_rate"} <= set(stage.data.metrics)
    stage_metrics = client.get_run(stage.info.run_id).data.metrics  # its own training figures only
    assert "scaling.pairs_per_s" in stage_metrics and "training.final_loss" in stage_metrics
    assert not [k for k in stage_metrics if k.startswith(("test.", "business.", "data."))], sorted(stage_metrics)
    assert "test.mrr_at_10.stage_1cpu_final" in parent.data.metrics  # the parent has every stage's evaluation
    artifacts = [a.path for a in client.list_artifacts(stage.info.run_id, "adapter")]
    assert "adapter/model.safetensors" in artifacts or "adapter/adapter_model.safetensors" in artifacts

    data_artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "data")}
    assert {"data/rejected_lines.jsonl", "data/data_counts.json", "data/smoke_train.parquet"} <= data_artifacts
    reporting = {a.path for a in client.list_artifacts(parent.info.run_id, "reporting")}
    assert {"reporting/evaluation_report.md", "reporting/evaluation_metrics.json", "reporting/plots"} <= reporting

    logging = json.loads((smoke_project / "data/08_reporting/mlflow_logging.json").read_text())
    model = mlflow.pyfunc.load_model(logging["model_uri"])
    scores = model.predict(pd.DataFrame([
        {"query_text": "red dress", "query_image": "", "doc_text": "a red cotton dress", "doc_image": ""},
        {"query_text": "red dress", "query_image": "", "doc_text": "blue leather shoes", "doc_image": ""},
    ]))
    assert len(scores) == 2 and all(0.0 < s < 1.0 for s in scores)
    # The logged model is the fine-tuned stage, not the base model it would fall back to without its adapter.
    from lychee_pipeline.reranker import Reranker

    final = json.loads((smoke_project / "data/06_models/stage_results/all_stages.json").read_text())[-1]
    stage_scores = Reranker.from_pretrained(str(smoke_project / final["adapter_dir"]), device="cpu").score_pairs(
        [({"text": "red dress"}, {"text": "a red cotton dress"}), ({"text": "red dress"}, {"text": "blue leather shoes"})])
    assert list(scores) == pytest.approx(stage_scores, abs=1e-5)


def test_full_pipeline_runs_stages_1_then_2_processes(tmp_path):
    root = make_project_copy(tmp_path)
    run_kedro(root, "full", {
        "gpus": 2,
        "model": {"finetune": "full"},
        "stages": {"check_steps": {1: 3}},
        "training": {"max_steps": 6, "learning_rate": 2e-3, "checkpoint_every": 100, "max_pixels": 12544},
        "evaluation": {"max_queries": 20},
    })
    stages = json.loads((root / "data/06_models/stage_results/all_stages.json").read_text())
    assert [(s["stage"], s["devices"], s["steps"]) for s in stages] == [
        ("stage_1cpu", 1, 3), ("stage_2cpu_final", 2, 6)]
    assert stages[1]["replica_max_diff"] == 0.0
    scaling = json.loads((root / "data/08_reporting/evaluation_metrics.json").read_text())
    rows = scaling["scaling"]["rows"]
    assert [(r["stage"], r["devices"]) for r in rows] == [("stage_1cpu", 1), ("stage_2cpu_final", 2)]
    assert all(r["pairs_per_s"] > 0 for r in rows)
    # the test-set scoring ran on the run's 2 processes too (one launch for every model)
    scoring = json.loads((root / "data/08_reporting/evaluation_scoring.json").read_text())
    assert {m["processes"] for m in scoring["models"].values()} == {2}
    assert (root / "data/07_model_output/scoring/launch.log").is_file()
    # one cosine decay per stage: the final stage's learning rate ends at zero at its last step
    assert stages[1]["learning_rates"][-1] == [6, pytest.approx(0.0, abs=1e-15)]
    # no warm-up step (int(0.05 x 6) = 0): the first step already decays, once, over the stage's 6 steps
    assert stages[1]["learning_rates"][0][1] == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi / 6)))
    _, parents, children = _runs(root)
    assert len(parents) == 1 and {c.data.tags["stage"] for c in children} == {"stage_1cpu", "stage_2cpu_final"}

    # the registry step of full: version 1 of lychee-reranker, the run's figures as tags, and the gate's decision
    # (against the base model: there is no champion yet) in the version's tags, the report and the run summary
    client = _client(root)
    outcome = json.loads((root / "data/08_reporting/registry_outcome.json").read_text())
    assert (outcome["status"], outcome["version"], outcome["reference"]) == ("registered", 1, "base model")
    version = client.get_model_version("lychee-reranker", "1")
    assert version.run_id == parents[0].info.run_id and version.tags["stage"] == "stage_2cpu_final"
    metrics = json.loads((root / "data/08_reporting/evaluation_mlflow_metrics.json").read_text())
    # the registry page's handful of tags; the run's figures and settings are in the outcome and the report
    from lychee_pipeline.runtime.files import sha256_file

    assert len(version.tags) <= 8 and version.tags["base_model"] == "builtin:tiny", version.tags
    assert version.tags["family"] == "qwen2_5_vl" and version.tags["gate.decision"] in ("champion", "not promoted")
    tables = {sha256_file(p) for p in (root / "data/06_models/runs").rglob("train.parquet")}
    assert version.tags["data.train_sha256"] in tables, (version.tags, tables)
    assert float(version.tags["test.mrr_at_10"]) == pytest.approx(metrics["test.mrr_at_10.finetuned"], abs=1e-4)
    details = outcome["details"]
    assert float(details["metric.test.mrr_at_10.finetuned"]) == pytest.approx(metrics["test.mrr_at_10.finetuned"])
    assert details["data.lines_in"] == "2400" and details["processing.training.max_pixels"] == "12544"
    assert version.description.startswith(outcome["reason"]) and outcome["reason"].startswith(
        "promoted: beats the base model" if outcome["promoted"] else "not promoted: does not beat the base model")
    assert ("champion" in version.aliases) == outcome["promoted"]
    summary = json.loads((root / "data/08_reporting/run_summary.json").read_text())
    assert summary["registry"]["version"] == 1 and summary["registry"]["promoted"] == outcome["promoted"]
    assert outcome["reason"] in (root / "data/08_reporting/registry_report.md").read_text()


def test_cli_refuses_more_gpus_than_visible(tmp_path):
    root = make_project_copy(tmp_path)
    env = dict(os.environ, KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "kedro", "run", "--pipeline", "full", "--params", "device=cuda,gpus=4",
         "--nodes", "training.plan_training_stages"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "gpus=4 asks for more GPUs than the 0 visible" in proc.stdout + proc.stderr


def test_smoke_on_the_tiny_qwen3_vl_model_lifts_mrr(tmp_path):
    """The second family through the same chain (issue 31): `kedro run --pipelines smoke` with
    `model.name_or_path=builtin:tiny-qwen3-vl` alone, trained on packed pairs (pack_pairs auto) and lifting MRR@10."""
    from project_runs import kedro_run, make_cli_project

    root = make_cli_project(tmp_path / "project")
    log = kedro_run(root / "notebooks", "--pipelines", "smoke", "--params", "model.name_or_path=builtin:tiny-qwen3-vl")
    assert "pack_pairs auto: padded batches" not in log  # the family packs
    metrics = json.loads((root / "data/08_reporting/evaluation_mlflow_metrics.json").read_text())
    base, tuned = metrics["test.mrr_at_10.base"], metrics["test.mrr_at_10.finetuned"]
    assert tuned > base + 0.1, f"fine-tuned MRR@10 {tuned:.3f} does not beat base {base:.3f} by 0.1"
    adapters = list((root / "data/06_models").rglob("lychee_reranker.json"))
    assert adapters and all(json.loads(a.read_text())["base_model"] == "builtin:tiny-qwen3-vl" for a in adapters)
    assert (root / "data/06_models/builtin_tiny_qwen3_vl/config.json").is_file()
