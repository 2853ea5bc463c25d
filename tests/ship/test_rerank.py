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

    # this file is made to show every refusal reason: the share of refused documents is allowed
    run_kedro(root, "rerank", {"rerank": {"input": str(candidates), "model": "models:/lychee-reranker@champion",
                                          "image_roots": str(images), "max_refused_share": 1.0}})

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


def _relative_candidates(queries: list[dict], images: Path) -> list[str]:
    """Candidates lines whose image paths are relative to the image root the model was logged with."""
    return [json.dumps({"id": q["query_id"], "query": _query(q, images),
                        "docs": [_doc(d, images, relative=True) for d in q["docs"]]}) for q in queries]


def test_relative_image_paths_resolve_under_the_roots_logged_with_the_model(champion_project, tmp_path):
    """Issue 32 item 1: with `images/x.jpg`-style paths relative to the training images and the README's command
    (no rerank.image_roots), the image documents were refused as `image not found` (the roots defaulted to the
    input file's folder) and the run exited 0. The batch rerank now resolves them as the served model does:
    under the roots logged with the model; the input file's folder is not a root (the server has none)."""
    root, images, queries = champion_project["root"], champion_project["images"], champion_project["queries"]
    elsewhere = tmp_path / "batch"
    elsewhere.mkdir()
    candidates = elsewhere / "candidates.jsonl"
    candidates.write_text("\n".join(_relative_candidates(queries[:6], images)) + "\n")
    run_kedro(root, "rerank", {"rerank": {"input": str(candidates), "model": "models:/lychee-reranker@champion"}})
    summary = json.loads((root / "data/08_reporting/rerank_summary.json").read_text())
    assert (summary["docs_scored"], summary["docs_refused"], summary["lines_refused"]) == (24, 0, 0), summary
    assert summary["image_roots"] == [str(images.resolve())]
    assert summary["image_roots_from"] == "the roots logged with the model"
    assert summary["max_refused_share"] == 0.0


def test_a_run_refusing_more_than_the_allowed_share_fails_in_one_line(champion_project, tmp_path):
    """The README's command on a file whose images are not under the model's roots: the run stops before
    scoring, non-zero, with one line giving the refused count by reason and the setting that allows it."""
    import subprocess
    import sys

    root, images, queries = champion_project["root"], champion_project["images"], champion_project["queries"]
    lines = _relative_candidates(queries[:3], images)
    lines.append(json.dumps({"id": "gone", "query": "red coat", "docs": [
        {"id": "a", "image": "images/missing.jpg"}, {"id": "b", "image": "http://shop.example/b.jpg"},
        {"id": "c", "text": "a red wool coat"}]}))
    candidates = tmp_path / "candidates.jsonl"
    candidates.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "kedro", "run", "--pipelines", "rerank", "--params",
               f"rerank.input={candidates},rerank.model=models:/lychee-reranker@champion"]
    for output in ("data/07_model_output/rerank_scores.parquet", "data/07_model_output/rerank_results.jsonl"):
        (root / output).unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING", "LYCHEE_IMAGE_ROOTS"))}
    env["COLUMNS"] = "400"  # a wide terminal: rich wraps the log at 80 columns where it cannot tell the width
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    message = ("rerank refused 2 of 15 documents (13.3%), more than rerank.max_refused_share=0 allows: "
               "image not found 1, URLs are not fetched (download the images and give local paths) 1 (first: line 4, "
               "doc a: image not found: "
               f"images/missing.jpg); image roots {[str(images.resolve())]} (the roots logged with the model); "
               "nothing was scored: fix the paths, set rerank.image_roots, or allow a share with "
               "--params rerank.max_refused_share=<0..1>")
    # a refusal: its one line is the last on the terminal
    assert out.strip().splitlines()[-1] == f"Error: {message}", [x for x in out.splitlines() if "refused" in x]
    assert message in (root / "info.log").read_text().splitlines()  # and one line in the log file
    assert not (root / "data/07_model_output/rerank_scores.parquet").exists()  # removed below before the run
    # the same file with the share allowed: the two documents are refused with their reasons, the rest scored
    run_kedro(root, "rerank", {"rerank": {"input": str(candidates), "model": "models:/lychee-reranker@champion",
                                          "max_refused_share": 0.2}})
    results = [json.loads(x) for x in (root / "data/07_model_output/rerank_results.jsonl").read_text().splitlines()]
    assert {d["doc_id"]: d["reason"] for d in results[3]["refused_docs"]} == {
        "a": "image not found: images/missing.jpg",
        "b": "URLs are not fetched (download the images and give local paths): http://shop.example/b.jpg"}
