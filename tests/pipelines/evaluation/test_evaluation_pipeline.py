"""Evaluation pipeline: candidates from contract-shaped records, the pipeline slice with SequentialRunner
on an in-memory catalog and on the project's catalog entries (real files), and scoring with the real
reranker when the reranker core is importable."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import yaml
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner
from PIL import Image
from stage_results import make_result

from lychee_pipeline.evaluation.report import PLOT_FILES
from lychee_pipeline.pipelines.evaluation import create_pipeline
from lychee_pipeline.evaluation.scoring import SCORE_COLUMNS, candidate_table, models_to_score

ROOT = Path(__file__).resolve().parents[3]
PARAMS = yaml.safe_load((ROOT / "conf/base/parameters_evaluation.yml").read_text())["evaluation"]
FAST_PARAMS = {**PARAMS, "significance": {**PARAMS["significance"], "n_resamples": 500}}

ITEM = pa.struct([("text", pa.string()), ("image", pa.string())])
POS = pa.struct([("doc_id", pa.string()), ("text", pa.string()), ("image", pa.string()), ("meta", pa.string())])
NEG = pa.struct([("doc_id", pa.string()), ("text", pa.string()), ("image", pa.string()), ("hard", pa.bool_()),
                 ("meta", pa.string())])
SCHEMA = pa.schema([("record_id", pa.string()), ("query", ITEM), ("positives", pa.list_(POS)),
                    ("negatives", pa.list_(NEG)), ("task_type", pa.string()), ("language", pa.string()),
                    ("split", pa.string())])


def make_records(n=4):
    rows = []
    for i in range(n):
        rows.append({
            "record_id": f"r{i}",
            "query": {"text": f"red running shoe {i}", "image": None},
            "positives": [{"doc_id": f"p{i}", "text": f"red running shoe model {i}", "image": None,
                           "meta": json.dumps({"popularity": 5 + i, "clicks": 12, "purchased": 1})}],
            "negatives": [
                {"doc_id": f"n{i}a", "text": "blue kettle", "image": None, "hard": True,
                 "meta": json.dumps({"popularity": 500, "clicks": 3})},
                {"doc_id": f"n{i}b", "text": "garden hose", "image": None, "hard": False, "meta": "{}"},
                {"doc_id": f"p{i}", "text": "duplicate of the positive", "image": None, "hard": False, "meta": "{}"},
            ],
            "task_type": "t2t",
            "language": "en" if i % 2 else "zh",
            "split": "test",
        })
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def test_candidates_from_contract_records():
    queries = candidate_table(make_records(), seed=0)
    assert [q["query_id"] for q in queries] == ["r0", "r1", "r2", "r3"]
    q = queries[1]
    assert (q["task_type"], q["language"], q["query"]) == ("t2t", "en", {"text": "red running shoe 1", "image": None})
    by_id = {c["doc_id"]: c for c in q["candidates"]}
    assert set(by_id) == {"p1", "n1a", "n1b"}  # the duplicate of the positive is dropped
    assert by_id["p1"]["label"] == 1 and by_id["n1a"]["label"] == 0
    assert by_id["p1"]["item"] == {"text": "red running shoe model 1", "image": None}
    assert (by_id["p1"]["popularity"], by_id["p1"]["clicks"], by_id["p1"]["purchased"]) == (6.0, 12.0, 1.0)
    assert math.isnan(by_id["n1b"]["popularity"])
    # the order is a seeded shuffle: reproducible, and not always positives first
    assert [c["doc_id"] for c in candidate_table(make_records(), 0)[1]["candidates"]] == [c["doc_id"] for c in q["candidates"]]
    firsts = {qq["candidates"][0]["label"] for qq in candidate_table(make_records(40), seed=0)}
    assert firsts == {0, 1}
    # pandas input (as read back from Parquet) works the same way
    from_pandas = candidate_table(make_records().to_pandas(), 0)[1]["candidates"]
    assert [(c["doc_id"], c["label"], c["item"]) for c in from_pandas] == [
        (c["doc_id"], c["label"], c["item"]) for c in q["candidates"]]


def test_models_to_score():
    stages = [make_result(stage="stage_1gpu", adapter_dir="/a").model_dump(), make_result(stage="stage_2gpu", adapter_dir="/b")]
    assert [(m.name, m.source, m.adapter) for m in models_to_score(stages, {"name_or_path": "builtin:tiny"})] == [
        ("base", "builtin:tiny", None), ("stage_1gpu", "builtin:tiny", "/a"), ("stage_2gpu", "builtin:tiny", "/b")]
    without_adapter = {k: v for k, v in make_result(stage="s").model_dump().items() if k != "adapter_dir"}
    with pytest.raises(ValueError, match="stage result 's' is not a valid StageResult: adapter_dir: Field required"):
        models_to_score([without_adapter], {"name_or_path": "x"})


def hand_scores():
    """A scores table as the scoring node writes it: base ranks the positive 2nd-4th, stages better."""
    rng = np.random.default_rng(0)
    rows = []
    for q in range(12):
        task, lang = ("t2t", "i2i")[q % 2], ("en", "zh", "und")[q % 3]
        docs = [f"p{q}"] + [f"n{q}_{j}" for j in range(4)]
        for position, doc in enumerate(docs):
            label = int(doc.startswith("p"))
            meta = {"clicks": float(rng.integers(0, 9)), "purchased": float(label and q % 3 == 0),
                    "popularity": float(rng.integers(1, 100))}
            for model, lift in (("base", -0.2), ("stage_1gpu", 0.6), ("stage_2gpu", 1.2)):
                rows.append({"model": model, "query_id": f"r{q}", "doc_id": doc, "label": label,
                             "score": float(rng.uniform() + lift * label), "position": position,
                             "task_type": task, "language": lang, **meta})
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


STAGES = [  # as the stage_results dataset holds them (JSON); timed over 100 steps without per-step timings
    make_result(stage="stage_1gpu", devices=1, device_type="cpu", wall_time_s=40.0, train_pairs=400, steps=100,
                step_seconds=[], pairs_per_s=10.0, peak_mem_gib=[2.0], adapter_dir="unused",
                losses=[[1, 0.9], [2, 0.7], [3, 0.6]], full_train_pairs=4000).model_dump(),
    make_result(stage="stage_2gpu", devices=2, device_type="cpu", wall_time_s=25.0, train_pairs=400, steps=100,
                step_seconds=[], pairs_per_s=16.0, peak_mem_gib=[2.1, 2.0], adapter_dir="unused",
                losses=[[1, 0.8], [2, 0.5]], full_train_pairs=4000, final=True).model_dump(),
]


def test_pipeline_slice_in_memory():
    pipe = create_pipeline().from_inputs("test_scores")
    assert "score_test_set" not in {n.name for n in pipe.nodes}
    catalog = DataCatalog({
        "test_scores": MemoryDataset(hand_scores()),
        "stage_results": MemoryDataset(STAGES),
        "evaluation_scoring": MemoryDataset({}),
        "params:evaluation": MemoryDataset(FAST_PARAMS),
    })
    outputs = SequentialRunner().run(pipe, catalog)
    assert set(outputs) == {"evaluation_metrics", "evaluation_report", "evaluation_plots", "evaluation_mlflow_metrics"}
    document = catalog.load("evaluation_metrics")
    ranking, scaling = document["ranking"], document["scaling"]
    assert set(ranking["models"]) == {"base", "stage_1gpu", "stage_2gpu"}
    assert ranking["finetuned"] == "stage_2gpu"
    cmp = ranking["comparisons"]["stage_2gpu"]["mrr_at_10"]
    assert cmp["finetuned"] > cmp["base"] and cmp["ci_low"] > 0
    assert scaling["full_train_pairs"] == 4000
    assert scaling["rows"][0]["label"] == "1 CPU process"
    assert scaling["rows"][1]["scaling_efficiency"] == pytest.approx(0.8)
    assert scaling["rows"][1]["mrr_at_10"] == ranking["models"]["stage_2gpu"]["overall"]["mrr_at_10"]
    assert scaling["rows"][0]["epoch_time_s"] == pytest.approx(400.0)
    flat = catalog.load("evaluation_mlflow_metrics")
    assert flat["test.mrr_at_10.finetuned"] == ranking["models"]["stage_2gpu"]["overall"]["mrr_at_10"]
    assert "business.expected_ctr_at_10.uplift" in flat and "scaling.stage_2gpu.pairs_per_s" in flat
    assert set(catalog.load("evaluation_plots")) == set(PLOT_FILES)
    assert "## Scaling" in catalog.load("evaluation_report")
    assert document["training"]["stage_2gpu"]["final_loss"] == 0.5


def project_catalog(tmp_path: Path) -> DataCatalog:
    """The project's catalog entries for evaluation, with every file under ``tmp_path``."""
    config = yaml.safe_load((ROOT / "conf/base/catalog_evaluation.yml").read_text())
    # entries also logged to MLflow wrap a file dataset: use the file dataset alone (no MLflow run here)
    config = {name: entry.get("dataset", entry) for name, entry in config.items()}
    for entry in config.values():
        entry["filepath"] = str(tmp_path / entry["filepath"])
    return DataCatalog.from_config(config)


def test_pipeline_slice_writes_the_reporting_files(tmp_path):
    catalog = project_catalog(tmp_path)
    catalog.save("test_scores", hand_scores())
    catalog.save("evaluation_scoring", {})
    catalog["stage_results"] = MemoryDataset(STAGES)
    catalog["params:evaluation"] = MemoryDataset(FAST_PARAMS)
    SequentialRunner().run(create_pipeline().from_inputs("test_scores"), catalog)

    reporting = tmp_path / "data/08_reporting"
    metrics = json.loads((reporting / "evaluation_metrics.json").read_text())
    assert set(metrics) == {"ranking", "business", "scaling", "training"}
    assert metrics["ranking"]["models"]["base"]["by_language"]["und"]["n_queries"] == 4
    assert "# Evaluation report" in (reporting / "evaluation_report.md").read_text()
    for name in PLOT_FILES:
        with Image.open(io.BytesIO((reporting / "plots" / name).read_bytes())) as image:
            image.load()
            assert image.format == "PNG"
    flat = json.loads((reporting / "evaluation_mlflow_metrics.json").read_text())
    assert all(isinstance(v, float) for v in flat.values())
    assert (tmp_path / "data/07_model_output/test_scores.parquet").is_file()
    layers = {name: entry["metadata"]["kedro-viz"]["layer"]
              for name, entry in yaml.safe_load((ROOT / "conf/base/catalog_evaluation.yml").read_text()).items()}
    assert layers.pop("test_scores") == "model_output" and set(layers.values()) == {"reporting"}


def _reranker_core():
    from lychee_pipeline.reranker import ModelConfig, load_reranker
    return ModelConfig, load_reranker


def test_whole_pipeline_with_the_tiny_reranker(tmp_path):
    """Scoring through the reranker core's batched inference (base + a stage adapter), then the report."""
    ModelConfig, load_reranker = _reranker_core()
    adapter = tmp_path / "adapter"
    load_reranker(ModelConfig(name_or_path="builtin:tiny", finetune="lora"), device="cpu").save_pretrained(adapter)
    stage = {**STAGES[0], "adapter_dir": str(adapter)}
    catalog = project_catalog(tmp_path)
    catalog["test_records"] = MemoryDataset(make_records(3), copy_mode="assign")
    catalog["stage_results"] = MemoryDataset([stage])
    catalog["params:model"] = MemoryDataset({"name_or_path": "builtin:tiny"})
    catalog["params:evaluation"] = MemoryDataset({
        **FAST_PARAMS, "reranker": {"batch_size": 4, "device": "cpu"},
        "scoring": {"work_dir": str(tmp_path / "scoring")}, "score_cache": {"dir": str(tmp_path / "cache")}})
    catalog["params:gpus"] = MemoryDataset(1)
    catalog["params:device"] = MemoryDataset("cpu")
    catalog["params:training"] = MemoryDataset({"max_length": 3200, "min_pixels": 3136, "max_pixels": 1003520})
    catalog["evaluation_plots"] = MemoryDataset(copy_mode="assign")  # PNG files: tested in the slice test
    outputs = SequentialRunner().run(create_pipeline(), catalog)
    assert "evaluation_plots" in outputs

    scores = pd.read_parquet(tmp_path / "data/07_model_output/test_scores.parquet")
    assert list(scores.columns) == SCORE_COLUMNS
    assert len(scores) == 2 * 3 * 3  # models x queries x distinct candidates
    assert set(scores["model"]) == {"base", "stage_1gpu"}
    assert scores["score"].between(0.0, 1.0).all()
    assert scores.groupby("model")["query_id"].nunique().tolist() == [3, 3]
    metrics = json.loads((tmp_path / "data/08_reporting/evaluation_metrics.json").read_text())
    assert metrics["ranking"]["models"]["base"]["overall"]["n_queries"] == 3
    assert metrics["scaling"]["rows"][0]["mrr_at_10"] == metrics["ranking"]["models"]["stage_1gpu"]["overall"]["mrr_at_10"]
    scoring = json.loads((tmp_path / "data/08_reporting/evaluation_scoring.json").read_text())
    assert scoring["models"]["base"]["pairs"] == 9 and scoring["models"]["base"]["reused"] is False
    assert metrics["scoring"]["models"]["stage_1gpu"]["pairs_per_s"] > 0
