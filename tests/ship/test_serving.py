"""`mlflow models serve -m "models:/lychee-reranker@champion" --env-manager local` answers /invocations with the
evaluation's scores for the same pairs, and refuses image paths outside the configured roots.

The server is started as a user starts it, on a free loopback port, against the champion project's sqlite store,
and stopped by its PID (its process group) at the end, whatever happened."""

from __future__ import annotations

import json
import os

import pytest

from ship_support import post_invocations as _post
from ship_support import served_model


def _golden_rows(project: dict) -> tuple[list[dict], list[float]]:
    """Mixed pairs (text, image, text+image on either side) with the evaluation's score of each.

    Images are sent both as paths relative to the image root and as absolute paths."""
    scores = project["scores"]
    final = scores[scores["model"] == "stage_1cpu_final"].set_index(["query_id", "doc_id"])["score"]
    root = project["images"]
    rows, expected = [], []
    for q in project["queries"][:8]:  # the four query kinds, twice
        for k, doc in enumerate(q["docs"]):
            if (k + int(q["query_id"][1:])) % 2:
                continue
            relative = lambda p: os.path.relpath(p, root) if p and k % 2 == 0 else p  # noqa: E731
            rows.append({"query_text": q["query"]["text"] or "", "query_image": relative(q["query"]["image"]) or "",
                         "doc_text": doc["text"] or "", "doc_image": relative(doc["image"]) or ""})
            expected.append(float(final[(q["query_id"], doc["doc_id"])]))
    kinds = {(bool(r["query_text"]), bool(r["query_image"]), bool(r["doc_text"]), bool(r["doc_image"])) for r in rows}
    assert len(kinds) >= 6, kinds  # text / image / both on each side
    return rows, expected


@pytest.fixture(scope="module")
def served_champion(champion_project, tmp_path_factory):
    """One server for the module's tests."""
    with served_model(champion_project["root"], champion_project["tracking_uri"], "models:/lychee-reranker@champion",
                      tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


def test_served_champion_scores_equal_the_evaluation(champion_project, served_champion):
    rows, expected = _golden_rows(champion_project)
    status, body = _post(served_champion["base"], {"dataframe_records": rows})
    assert status == 200, body
    served = body["predictions"]
    assert len(served) == len(expected)
    assert max(abs(a - b) for a, b in zip(served, expected)) <= 1e-5, list(zip(served, expected))

    # the same request in the split orientation (what `curl` in docs/serving.md sends)
    columns = list(rows[0])
    status, body = _post(served_champion["base"],
                         {"dataframe_split": {"columns": columns, "data": [[r[c] for c in columns] for r in rows[:3]]}})
    assert status == 200 and body["predictions"] == pytest.approx(expected[:3], abs=1e-5)


@pytest.mark.parametrize("path, message", [
    ("/etc/hostname", "outside the allowed image roots"),
    ("../../../etc/hostname", "outside the allowed image roots"),
    ("nowhere.png", "image not found under the allowed image roots"),
])
def test_served_model_refuses_images_outside_the_roots(served_champion, path, message):
    row = {"query_text": "red dress", "query_image": "", "doc_text": "", "doc_image": "img0.png"}
    status, body = _post(served_champion["base"], {"dataframe_records": [row, {**row, "doc_image": path}]})
    assert status == 400, body
    assert message in body.get("message", "") and "row 1" in body["message"], body
    # the refusal's line alone: MLflow wrapped it as "Failed to predict data '<the request>'. Error: ..."
    assert body["message"].startswith("row 1: ") and "\n" not in body["message"], body
    assert body["error_code"] == "INVALID_PARAMETER_VALUE", body
    print("served refusal:", json.dumps(body))
