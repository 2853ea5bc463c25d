"""Business proxies on hand-made rankings whose values are worked out here."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lychee_pipeline.evaluation.business import (
    business_metrics,
    click_probabilities,
    compare_business,
    examination_probabilities,
    tail_items,
    uplift,
)
from lychee_pipeline.evaluation.metrics import rank_candidates

E2, E3 = 1 / math.log2(3), 1 / math.log2(4)  # log2 examination at ranks 2 and 3


def ranked(rows, **extra):
    """rows: (query_id, doc_id, label, rank) plus meta columns given as lists in ``extra``."""
    df = pd.DataFrame(rows, columns=["query_id", "doc_id", "label", "rank"])
    for name, values in extra.items():
        df[name] = values
    return df


def test_examination_models():
    assert examination_probabilities([1, 2, 3]).tolist() == pytest.approx([1.0, E2, E3])
    assert examination_probabilities([1, 2, 4], "reciprocal").tolist() == pytest.approx([1.0, 0.5, 0.25])
    assert examination_probabilities([1, 2, 3], [0.9, 0.4]).tolist() == pytest.approx([0.9, 0.4, 0.0])
    with pytest.raises(ValueError):
        examination_probabilities([1], "cascade")
    with pytest.raises(ValueError):
        examination_probabilities([0])


def test_ctr_and_clicks_from_labels():
    table = ranked([("q", "a", 0, 1), ("q", "b", 1, 2), ("q", "c", 1, 3)])
    at2 = business_metrics(table, k=2)
    assert at2["expected_clicks_at_k"] == pytest.approx(E2)
    assert at2["expected_ctr_at_k"] == pytest.approx(E2)
    at3 = business_metrics(table, k=3)
    assert at3["expected_clicks_at_k"] == pytest.approx(E2 + E3)
    assert at3["expected_ctr_at_k"] == pytest.approx(1 - (1 - E2) * (1 - E3))
    recip = business_metrics(table, k=3, examination="reciprocal")
    assert recip["expected_clicks_at_k"] == pytest.approx(1 / 2 + 1 / 3)


def test_click_probability_prefers_normalised_clicks_and_falls_back_to_labels():
    # clicks 10, 5, missing -> 1, 0.5, and the label (graded 2 of max 2) for the third
    table = ranked([("q", "a", 0, 1), ("q", "b", 0, 2), ("q", "c", 2, 3)], clicks=[10.0, 5.0, np.nan])
    assert click_probabilities(table).tolist() == pytest.approx([1.0, 0.5, 1.0])
    figures = business_metrics(table, k=3)
    assert figures["expected_clicks_at_k"] == pytest.approx(1.0 + 0.5 * E2 + E3)
    assert figures["expected_ctr_at_k"] == pytest.approx(1.0)  # rank 1 is examined and clicked for sure


def test_expected_purchases():
    table = ranked([("q1", "a", 1, 1), ("q1", "b", 0, 2), ("q2", "c", 0, 1), ("q2", "d", 1, 2)],
                   purchased=[0.0, 1.0, 1.0, np.nan])
    # q1: purchase at rank 2 -> E2; q2: purchase at rank 1 -> 1 (missing counts as 0); mean over queries
    assert business_metrics(table, k=2)["expected_purchases_at_k"] == pytest.approx((E2 + 1.0) / 2)
    assert business_metrics(table, k=1)["expected_purchases_at_k"] == pytest.approx(0.5)
    assert business_metrics(table.drop(columns="purchased"), k=2)["expected_purchases_at_k"] is None


def _catalogue():
    # popularity: d1 100, d2 50, d3 10, d4 5, d5 1 -> the tail (80% of 5 = 4) is d2..d5
    return ranked(
        [("q1", "d1", 1, 1), ("q1", "d2", 0, 2), ("q1", "d3", 0, 3),
         ("q2", "d1", 0, 1), ("q2", "d4", 1, 2), ("q2", "d5", 0, 3)],
        popularity=[100.0, 50.0, 10.0, 100.0, 5.0, 1.0],
    )


def test_long_tail_share_and_coverage():
    table = _catalogue()
    assert tail_items(table, 0.8) == {"d2", "d3", "d4", "d5"}
    assert tail_items(table, 0.4) == {"d4", "d5"}
    at1 = business_metrics(table, k=1)
    assert at1["long_tail_share_at_k"] == 0.0       # both top slots are d1
    assert at1["coverage_at_k"] == pytest.approx(1 / 5)
    at2 = business_metrics(table, k=2)
    assert at2["long_tail_share_at_k"] == pytest.approx(2 / 4)  # d1 d2 | d1 d4
    assert at2["coverage_at_k"] == pytest.approx(3 / 5)
    assert business_metrics(table.drop(columns="popularity"), k=2)["long_tail_share_at_k"] is None


def test_uplift_and_comparison_between_models():
    base = _catalogue()
    # the fine-tuned model puts the tail item first in q2: slots d1 d2 | d4 d1
    ft = base.copy()
    ft.loc[(ft.query_id == "q2") & (ft.doc_id == "d4"), "rank"] = 1
    ft.loc[(ft.query_id == "q2") & (ft.doc_id == "d1"), "rank"] = 2
    result = compare_business({"base": base, "stage_2gpu": ft}, ks=[1, 2])
    assert result["finetuned"] == "stage_2gpu"
    share = result["comparison"]["long_tail_share_at_1"]
    assert share["base"] == 0.0 and share["finetuned"] == 0.5 and share["uplift"] == 0.5
    assert share["uplift_rel"] is None  # relative to zero
    clicks = result["comparison"]["expected_clicks_at_1"]
    # base: q1 rank1 is relevant (1), q2 rank1 is not (0) -> 0.5; fine-tuned: both -> 1.0
    assert clicks == pytest.approx({"base": 0.5, "finetuned": 1.0, "uplift": 0.5, "uplift_rel": 1.0})
    assert set(result["models"]["base"]) == {
        f"{m}_at_{k}" for k in (1, 2)
        for m in ("expected_ctr", "expected_clicks", "expected_purchases", "long_tail_share", "coverage")
    }
    assert uplift(None, 1.0)["uplift"] is None


def test_business_metrics_follow_the_ranking_tie_breaking():
    scores = pd.DataFrame({"query_id": ["q"] * 3, "doc_id": ["a", "b", "c"], "label": [1, 0, 0],
                           "score": [0.2, 0.9, 0.5]})
    table = rank_candidates(scores)
    assert business_metrics(table, k=2)["expected_clicks_at_k"] == 0.0  # a is ranked third
    assert business_metrics(table, k=3)["expected_clicks_at_k"] == pytest.approx(E3)
