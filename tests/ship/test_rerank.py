"""`kedro run --pipelines rerank --params "rerank.input=<jsonl>,rerank.model=models:/lychee-reranker@champion"` in a
project copy whose store holds a champion: every line scored or refused with its reason, the scores equal the
evaluation's for the same pairs, ranks follow the scores, a summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from project_runs import run_kedro


def _doc(d: dict, images: Path, relative: bool) -> dict:
    out = {"id": d["doc_id"]}
    if d["text"]:
        out["text"] = d["text"]
    if d["image"]:
        out["image"] = os.path.relpath(d["image"], images) if relative else d["image"]
    return out


def _query(q: dict, images: Path):
    if q["query"]["image"] is None:
        return q["query"]["text"]  # the raw format's plain-string query
    return {k: (os.path.relpath(v, images) if k == "image" else v) for k, v in q["query"].items() if v}


def test_rerank_pipeline_scores_and_accounts_for_every_line(champion_project, tmp_path):
    root, images, queries = champion_project["root"], champion_project["images"], champion_project["queries"]
    (images / "not_an_image.png").write_text("this is text\n")
    good = [queries[0], queries[2], queries[3]]  # text query, image query, text+image query
    lines = [json.dumps({"id": q["query_id"], "query": _query(q, images),
                         "docs": [_doc(d, images, relative=i % 2 == 0) for d in q["docs"]]}) for i, q in enumerate(good)]
    lines += [
        '{"id": "broken", "query": "red dress", "docs": [',                                        # 4 malformed
        "",                                                                                        # 5 empty line
        json.dumps({"id": "escape", "query": {"image": "/etc/hostname"}, "docs": [{"text": "x"}]}),  # 6 query image
        json.dumps({"id": "some-bad", "query": "blue coat", "docs": [
            {"id": "gone", "image": "missing.png"}, {"id": "bad", "image": "not_an_image.png"},
            {"id": "ok", "text": "a blue wool coat"}]}),                                           # 7 two docs refused
        json.dumps({"id": "nodocs", "query": "hat", "docs": []}),                                 # 8 no documents
        json.dumps({"id": "typo", "query": "hat", "candidates": [{"text": "a hat"}]}),            # 9 unknown field
    ]
    candidates = tmp_path / "candidates.jsonl"
    candidates.write_text("\n".join(lines) + "\n")

    run_kedro(root, "rerank", {"rerank": {"input": str(candidates), "model": "models:/lychee-reranker@champion",
                                          "image_roots": str(images)}})

    results = [json.loads(x) for x in (root / "data/07_model_output/rerank_results.jsonl").read_text().splitlines()]
    assert [r["line"] for r in results] == list(range(1, 10))  # every input line, in order
    status = {r["line"]: (r["status"], r.get("reason")) for r in results}
    assert [status[i][0] for i in (1, 2, 3, 7)] == ["scored"] * 4
    assert status[4][1].startswith("malformed JSON")
    assert status[5][1] == "empty line"
    assert status[6][1] == "query image: path escapes the image roots: /etc/hostname"
    assert status[8][1] == "no documents"
    assert status[9][1] == "unknown field 'candidates' (a line has: id, query, docs)"
    partial = results[6]
    assert {d["doc_id"]: d["reason"] for d in partial["refused_docs"]} == {
        "gone": "image not found: missing.png", "bad": "not a decodable image: not_an_image.png"}
    assert [d["doc_id"] for d in partial["ranked"]] == ["ok"]

    # the champion's scores through the batch scorer equal the evaluation's for the same pairs
    evaluation = champion_project["scores"]
    evaluation = evaluation[evaluation["model"] == "stage_1cpu_final"].set_index(["query_id", "doc_id"])["score"]
    for result, q in zip(results[:3], good):
        assert result["query_id"] == q["query_id"] and len(result["ranked"]) == 4
        for d in result["ranked"]:
            assert d["score"] == pytest.approx(float(evaluation[(q["query_id"], d["doc_id"])]), abs=1e-5)
        ranked_scores = [d["score"] for d in result["ranked"]]
        assert ranked_scores == sorted(ranked_scores, reverse=True) and [d["rank"] for d in result["ranked"]] == [1, 2, 3, 4]

    table = pd.read_parquet(root / "data/07_model_output/rerank_scores.parquet")
    assert len(table) == 12 + 3 + 5  # 12 documents of the good lines, 3 of line 7, one row per refused line (5)
    assert set(table["line"]) == set(range(1, 10))
    assert table["score"].notna().sum() == 13 and table.loc[table["status"] == "refused", "reason"].notna().all()

    summary = json.loads((root / "data/08_reporting/rerank_summary.json").read_text())
    assert (summary["lines_in"], summary["lines_scored"], summary["lines_refused"]) == (9, 4, 5)
    assert (summary["docs_scored"], summary["docs_refused"]) == (13, 2)
    assert (summary["model_name"], summary["model_version"], summary["model_alias"]) == ("lychee-reranker", 1, "champion")
    assert summary["refused_lines_by_reason"]["empty line"] == 1
