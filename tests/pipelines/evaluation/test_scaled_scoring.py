"""Evaluation that scales with the run (issue 18), with the real tiny reranker and real processes:

- sharded scoring through the launcher (`accelerate launch`, 2 CPU processes over gloo) gives the
  single-process scores to 1e-6, in the original pair order;
- the base model's scores come from the score cache when the model, processing settings and test pairs
  match, and are recomputed when the split or a setting changes;
- check stages are scored on a fixed seeded sample of the test queries, and the report says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from PIL import Image
from stage_results import make_result

from lychee_pipeline.evaluation.scoring_report import add_scoring, scoring_mlflow_metrics
from lychee_pipeline.evaluation.scoring import BASE, candidate_table, sample_queries
from lychee_pipeline.pipelines.evaluation.nodes import (
    build_report,
    compute_business_metrics,
    compute_ranking_metrics,
    compute_scaling_report,
    score_test_set,
)
from lychee_pipeline.reranker.tiny import ensure_tiny
from lychee_pipeline.runtime.heartbeat import read_heartbeats

ROOT = Path(__file__).resolve().parents[3]
PARAMS = yaml.safe_load((ROOT / "conf/base/parameters_evaluation.yml").read_text())["evaluation"]
FAST_PARAMS = {**PARAMS, "significance": {**PARAMS["significance"], "n_resamples": 200}}
ITEM = pa.struct([("text", pa.string()), ("image", pa.string())])
POS = pa.struct([("doc_id", pa.string()), ("text", pa.string()), ("image", pa.string()), ("meta", pa.string())])
NEG = pa.struct([("doc_id", pa.string()), ("text", pa.string()), ("image", pa.string()), ("hard", pa.bool_()),
                 ("meta", pa.string())])
SCHEMA = pa.schema([("record_id", pa.string()), ("query", ITEM), ("positives", pa.list_(POS)),
                    ("negatives", pa.list_(NEG)), ("task_type", pa.string()), ("language", pa.string()),
                    ("split", pa.string())])

TRAINING = {"max_length": 3200, "min_pixels": 3136, "max_pixels": 12544,
            "launch": {"timeout_s": 300, "threads_per_process": 1}}


def make_records(tmp_path, n=6, texts=("red running shoe", "blue kettle", "garden hose", "wool scarf")):
    """Records of mixed lengths and modalities (some candidates are images), so batches really differ by shard."""
    images = []
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (28 * (i + 1), 28 * (i + 2)), colour).save(path)
        images.append(str(path))
    rows = []
    for i in range(n):
        rows.append({
            "record_id": f"r{i}",
            "query": {"text": f"{texts[i % len(texts)]} {'with a long description ' * (i % 3)}{i}", "image": None},
            "positives": [{"doc_id": f"p{i}", "text": f"{texts[i % len(texts)]} model {i}", "image": None,
                           "meta": json.dumps({"popularity": 5 + i, "clicks": 12, "purchased": 1})}],
            "negatives": [
                {"doc_id": f"n{i}a", "text": None, "image": images[i % 3], "hard": True, "meta": "{}"},
                {"doc_id": f"n{i}b", "text": "a plain " + "very " * i + "long kettle", "image": None, "hard": False,
                 "meta": "{}"},
            ],
            "task_type": "t2t",
            "language": "en",
            "split": "test",
        })
    return pa.Table.from_pylist(rows, schema=SCHEMA)


@pytest.fixture
def scoring_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_TINY_DIR", str(ensure_tiny(tmp_path.parent / "tiny_for_scoring")))
    return tmp_path


def params(tmp_path, **extra):
    return {**FAST_PARAMS, "reranker": {"batch_size": 3, "device": "cpu"},
            "scoring": {"work_dir": str(tmp_path / "scoring")},
            "score_cache": {"enabled": True, "dir": str(tmp_path / "cache")}, **extra}


def test_two_cpu_processes_give_the_single_process_scores(scoring_env):
    tmp_path = scoring_env
    records = make_records(tmp_path, n=7)  # 21 pairs: the shards are unequal (11 and 10)
    model = {"name_or_path": "builtin:tiny"}
    one, fig1 = score_test_set(records, [], model, params(tmp_path, score_cache={"enabled": False}), 1, "cpu", TRAINING)
    two, fig2 = score_test_set(records, [], model, params(tmp_path, score_cache={"enabled": False}), 2, "cpu", TRAINING)
    assert fig1["models"][BASE]["processes"] == 1
    assert fig2["models"][BASE]["processes"] == 2 and fig2["processes"] == 2
    assert len(two) == len(one) == 21
    assert list(two["query_id"]) == list(one["query_id"]) and list(two["doc_id"]) == list(one["doc_id"])
    np.testing.assert_allclose(two["score"].to_numpy(), one["score"].to_numpy(), rtol=0, atol=1e-6)
    assert one["score"].nunique() > 5  # real, distinct scores, not a constant
    # it really ran through `accelerate launch` with two ranks, each scoring its shard
    log = (tmp_path / "scoring" / "launch.log").read_text()
    # each rank showed the launcher's watchdog its progress (a silent scoring launch is stopped), and left
    beats = read_heartbeats(tmp_path / "scoring")
    assert sorted(beats) == [0, 1] and all(b["phase"] == "done" for b in beats.values()), beats
    assert "[rank 0]" in log and "[rank 1]" in log
    result = json.loads((tmp_path / "scoring" / "result.json").read_text())
    assert result["processes"] == 2 and len(result["jobs"][0]["rank_scoring_seconds"]) == 2
    assert fig2["models"][BASE]["pairs_per_s"] > 0 and fig2["models"][BASE]["seconds"] > 0


def test_base_scores_are_cached_and_recomputed_when_anything_changes(scoring_env):
    tmp_path = scoring_env
    records = make_records(tmp_path, n=4)
    model = {"name_or_path": "builtin:tiny"}
    first, f1 = score_test_set(records, [], model, params(tmp_path), 1, "cpu", TRAINING)
    assert f1["models"][BASE]["reused"] is False and f1["models"][BASE]["cache_key"]
    again, f2 = score_test_set(records, [], model, params(tmp_path), 1, "cpu", TRAINING)
    assert f2["models"][BASE]["reused"] is True
    assert f2["models"][BASE]["cache_key"] == f1["models"][BASE]["cache_key"]
    assert again["score"].tolist() == first["score"].tolist()

    # a changed test split (one more query) recomputes
    _, f3 = score_test_set(make_records(tmp_path, n=5), [], model, params(tmp_path), 1, "cpu", TRAINING)
    assert f3["models"][BASE]["reused"] is False
    # a changed processing setting recomputes, and gives other scores
    changed, f4 = score_test_set(records, [], model, params(tmp_path), 1, "cpu", {**TRAINING, "max_pixels": 3136})
    assert f4["models"][BASE]["reused"] is False and f4["models"][BASE]["cache_key"] != f1["models"][BASE]["cache_key"]
    # a changed image file (same path) recomputes
    Image.new("RGB", (56, 28), (9, 9, 9)).save(tmp_path / "img0.png")
    _, f5 = score_test_set(records, [], model, params(tmp_path), 1, "cpu", TRAINING)
    assert f5["models"][BASE]["reused"] is False
    # the batch size is not part of the key
    _, f6 = score_test_set(records, [], model, {**params(tmp_path), "reranker": {"batch_size": 2, "device": "cpu"}},
                           1, "cpu", TRAINING)
    assert f6["models"][BASE]["reused"] is True
    entry = json.loads((tmp_path / "cache" / f"{f1['models'][BASE]['cache_key']}.json").read_text())
    assert entry["model"]["model"].startswith("builtin:tiny recipe ") and entry["processing"]["max_pixels"] == 12544

    report = add_scoring("# r\n", f2)
    assert "reused from the score cache" in report
    assert scoring_mlflow_metrics(f2)["eval.base.reused"] == 1.0


def test_check_stages_are_scored_on_a_seeded_sample_and_marked(scoring_env):
    tmp_path = scoring_env
    records = make_records(tmp_path, n=8)
    queries = candidate_table(records, 0)
    sample = sample_queries(queries, 3, 0)
    assert [q["query_id"] for q in sample] == [q["query_id"] for q in sample_queries(queries, 3, 0)]  # fixed
    assert len({q["query_id"] for q in sample}) == 3
    tiny = str(ensure_tiny())
    stages = [
        make_result(stage="stage_1cpu", adapter_dir=tiny, final=False, devices=1, device_type="cpu", wall_time_s=4.0,
                    peak_mem_gib=[1.0], train_pairs=8, steps=3, pairs_per_s=5.0, losses=[[1, 0.7], [2, 0.6]]).model_dump(),
        make_result(stage="stage_2cpu_final", adapter_dir=tiny, final=True, devices=2, device_type="cpu", wall_time_s=5.0,
                    peak_mem_gib=[1.0, 1.0], train_pairs=16, steps=6, pairs_per_s=9.0,
                    losses=[[1, 0.7], [2, 0.5]]).model_dump(),
    ]
    evaluation = params(tmp_path, check_stage_queries=3, score_cache={"enabled": False})
    scores, scoring = score_test_set(records, stages, {"name_or_path": "builtin:tiny"}, evaluation, 1, "cpu", TRAINING)
    per_model = scores.groupby("model")["query_id"].nunique().to_dict()
    assert per_model == {"base": 8, "stage_1cpu": 3, "stage_2cpu_final": 8}
    assert set(scores[scores.model == "stage_1cpu"].query_id) == {q["query_id"] for q in sample}
    assert scoring["models"]["stage_1cpu"]["sampled"] is True
    assert not scoring["models"]["stage_2cpu_final"]["sampled"] and not scoring["models"]["base"]["sampled"]
    # same model, same pairs: the sampled stage's scores equal the base's on those queries
    base = scores[scores.model == "base"].set_index(["query_id", "doc_id"])["score"]
    check = scores[scores.model == "stage_1cpu"].set_index(["query_id", "doc_id"])["score"]
    np.testing.assert_allclose(check.to_numpy(), base.loc[check.index].to_numpy(), atol=1e-6)

    ranking = compute_ranking_metrics(scores, evaluation)
    business = compute_business_metrics(scores, evaluation)
    scaling = compute_scaling_report(stages, ranking, evaluation)
    document, report, _, metrics = build_report(ranking, business, scaling, stages, scoring)
    assert ranking["comparisons"]["stage_1cpu"]["mrr_at_10"]["n_queries"] == 3
    assert "**Sampled figures:** `stage_1cpu`" in report and "3 of 8 (sampled)" in report
    assert document["scoring"]["models"]["stage_1cpu"]["sampled"] is True
    assert metrics["eval.stage_1cpu.sampled"] == 1.0 and metrics["eval.stage_2cpu_final.pairs_per_s"] > 0
    assert metrics["eval.base.seconds"] > 0
