"""The second family after training (issue 31): a Qwen3-VL reranker registered as champion, served by `mlflow models
serve` and run through the `rerank` pipeline, scores as the evaluation scored it, with the processing settings it was
trained with (not the family's defaults).

Real parts: builtin:tiny-qwen3-vl with a LoRA adapter of non-zero weights saved with a pixel budget of its own
(every image of the candidate set is resized to 128 x 128 instead of the family's 4-token floor), the evaluation's
scoring and the registry node of `full` in a project copy with a sqlite MLflow store, the server started as a user
starts it on 127.0.0.1 and stopped by its PID, and `kedro run --pipelines rerank` through KedroSession.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pandas as pd
import pytest
import torch

from project_runs import make_project_copy, run_kedro
from ship_support import (candidate_queries, make_test_records, mlflow_store, post_invocations, register_run,
                          score_pairs, served_model)

#: far from the family's defaults (max_length 10240, 4096 to 1843200 pixels): each 40-88 x 48 image becomes 128 x 128
TRAINED = {"max_length": 1024, "min_pixels": 16384, "max_pixels": 16384, "instructions": None}


@pytest.fixture(scope="module")
def qwen3_champion_project(tmp_path_factory, ship_images) -> dict[str, Any]:
    """A project copy whose store holds `lychee-reranker` version 1, a LoRA adapter on builtin:tiny-qwen3-vl, as
    champion: it beat its base model on a test split whose labels are its own first choices."""
    from lychee_pipeline.reranker.model import ModelConfig, load_reranker
    from lychee_pipeline.reranker.processing import ProcessingConfig
    from lychee_pipeline.reranker.tiny import ensure_tiny

    models = tmp_path_factory.mktemp("qwen3_models")
    base = ensure_tiny(models / "builtin_tiny_qwen3_vl", name="builtin:tiny-qwen3-vl")
    model = load_reranker(ModelConfig(name_or_path=str(base), finetune="lora"), device="cpu")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # LoRA's B starts at zero; large values make a model that ranks unlike its base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    adapter = str(model.save_pretrained(models / "stage_1cpu_final", processing=ProcessingConfig.from_dict(TRAINED)))
    del model

    root = make_project_copy(tmp_path_factory.mktemp("qwen3_champion_project"))
    with mlflow_store(root):
        queries = candidate_queries(ship_images)
        records = make_test_records(queries, score_pairs(adapter, queries))
        outcome, scores = register_run(records, adapter, str(base), ship_images)
    assert outcome["promoted"] and outcome["version"] == 1, outcome
    return {"root": root, "tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "queries": queries, "scores": scores,
            "images": ship_images, "adapter": adapter}


def _evaluation_scores(project: dict) -> pd.Series:
    scores = project["scores"]
    return scores[scores["model"] == "stage_1cpu_final"].set_index(["query_id", "doc_id"])["score"]


def test_a_qwen3_vl_champion_serves_and_reranks_at_the_evaluations_scores(qwen3_champion_project, tmp_path):
    from lychee_pipeline.reranker import Reranker
    from lychee_pipeline.reranker.families import family_for

    project, evaluation = qwen3_champion_project, _evaluation_scores(qwen3_champion_project)
    root, images = project["root"], project["images"]
    queries = project["queries"][:8]  # the four query kinds, twice; every document kind on the other side
    keys = [(q["query_id"], d["doc_id"]) for q in queries for d in q["docs"]]
    expected = [float(evaluation[k]) for k in keys]
    with_images = [i for i, (q, d) in enumerate((q, d) for q in queries for d in q["docs"])
                   if q["query"]["image"] or d["image"]]

    # the check can fail: the family's default processing scores the image pairs differently
    defaults = Reranker.from_pretrained(project["adapter"], device="cpu", **family_for("qwen3_vl").PROCESSING_DEFAULTS)
    pairs = [(q["query"], {"text": d["text"], "image": d["image"]}) for q in queries for d in q["docs"]]
    untravelled = defaults.score_pairs(pairs)
    assert max(abs(untravelled[i] - expected[i]) for i in with_images) > 1e-3

    # served: images as paths relative to the logged image root
    rel = lambda p: os.path.relpath(p, images) if p else ""  # noqa: E731
    rows = [{"query_text": q["query"]["text"] or "", "query_image": rel(q["query"]["image"]),
             "doc_text": d["text"] or "", "doc_image": rel(d["image"])} for q in queries for d in q["docs"]]
    with served_model(root, project["tracking_uri"], "models:/lychee-reranker@champion",
                      tmp_path / "serve.log") as server:
        status, body = post_invocations(server["base"], {"dataframe_records": rows})
        refused_status, refused = post_invocations(server["base"], {"dataframe_records": [
            {**rows[0], "doc_image": "/etc/hostname"}]})
    assert status == 200, body
    served = body["predictions"]
    assert len(served) == len(expected) and max(abs(a - b) for a, b in zip(served, expected)) <= 1e-5, \
        list(zip(served, expected))
    assert refused_status == 400 and "outside the allowed image roots" in refused["message"], refused

    # batch: the rerank pipeline on a candidates file, images resolved under the roots logged with the model
    lines = [{"id": q["query_id"], "query": {k: rel(v) if k == "image" else v for k, v in q["query"].items() if v},
              "docs": [{"id": d["doc_id"], **({"text": d["text"]} if d["text"] else {}),
                        **({"image": rel(d["image"])} if d["image"] else {})} for d in q["docs"]]} for q in queries]
    candidates = tmp_path / "candidates.jsonl"
    candidates.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_kedro(root, "rerank", {"rerank": {"input": str(candidates), "model": "models:/lychee-reranker@champion"}})
    results = [json.loads(x) for x in (root / "data/07_model_output/rerank_results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in results] == ["scored"] * len(queries), results
    batch = {(r["query_id"], d["doc_id"]): d["score"] for r in results for d in r["ranked"]}
    assert sorted(batch) == sorted(keys)
    assert max(abs(batch[k] - e) for k, e in zip(keys, expected)) <= 1e-5
    summary = json.loads((root / "data/08_reporting/rerank_summary.json").read_text())
    assert (summary["model_version"], summary["docs_scored"]) == (1, len(keys))
