"""Ranking metrics on small hand-made rankings whose values are worked out here."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lychee_pipeline.evaluation.metrics import (
    METRIC_NAMES,
    evaluate_models,
    paired_comparison,
    per_query_metrics,
    rank_candidates,
)


def table(rows, task_type="t2t", language="en"):
    """rows: (query_id, doc_id, label, score[, task_type, language])."""
    out = []
    for r in rows:
        q, d, label, score = r[:4]
        out.append({
            "query_id": q, "doc_id": d, "label": label, "score": score,
            "task_type": r[4] if len(r) > 4 else task_type, "language": r[5] if len(r) > 5 else language,
        })
    return pd.DataFrame(out)


def test_binary_ranking_values():
    # qa ranks a1(0) a2(1) a3(0) a4(1); qb ranks b1(1) b2(0)
    scores = table([
        ("qa", "a4", 1, 0.1), ("qa", "a2", 1, 0.8), ("qa", "a1", 0, 0.9), ("qa", "a3", 0, 0.7),
        ("qb", "b2", 0, 0.4), ("qb", "b1", 1, 0.5),
    ])
    pq = per_query_metrics(scores)
    qa, qb = pq.loc["qa"], pq.loc["qb"]
    assert qa["mrr_at_10"] == pytest.approx(1 / 2)
    assert qa["recall_at_1"] == 0.0
    assert qa["recall_at_5"] == 1.0 and qa["recall_at_10"] == 1.0
    assert qa["map"] == pytest.approx((1 / 2 + 2 / 4) / 2)
    dcg = 1 / math.log2(3) + 1 / math.log2(5)
    idcg = 1 + 1 / math.log2(3)
    assert qa["ndcg_at_10"] == pytest.approx(dcg / idcg)
    assert qb[list(METRIC_NAMES)].tolist() == [1.0] * len(METRIC_NAMES)

    overall = evaluate_models({"base": scores})["models"]["base"]["overall"]
    assert overall["mrr_at_10"] == pytest.approx((0.5 + 1.0) / 2)
    assert overall["ndcg_at_10"] == pytest.approx((dcg / idcg + 1.0) / 2)
    assert overall["n_queries"] == 2


def test_graded_labels_use_linear_gain_and_threshold_one():
    # order: c1 (grade 1), c2 (grade 2), c3 (grade 0)
    scores = table([("q", "c1", 1, 3.0), ("q", "c2", 2, 2.0), ("q", "c3", 0, 1.0)])
    row = per_query_metrics(scores).loc["q"]
    assert row["ndcg_at_10"] == pytest.approx((1 + 2 / math.log2(3)) / (2 + 1 / math.log2(3)))
    assert row["mrr_at_10"] == 1.0  # grade 1 already counts as relevant
    assert row["recall_at_1"] == pytest.approx(1 / 2)


def test_cutoff_at_ten():
    rows = [("q", f"n{i}", 0, 1.0 - i / 100) for i in range(10)] + [("q", "p", 1, 0.0)]
    row = per_query_metrics(table(rows)).loc["q"]
    assert row["mrr_at_10"] == 0.0 and row["recall_at_10"] == 0.0 and row["ndcg_at_10"] == 0.0
    assert row["map"] == pytest.approx(1 / 11)  # MAP has no cut-off


def test_ties_are_broken_by_the_seeded_shuffle_not_input_order():
    # 300 queries, the positive listed first and every score equal: input order must not help.
    rows = [(f"q{i}", d, int(d == "pos"), 0.5) for i in range(300) for d in ("pos", "n1", "n2", "n3")]
    scores = table(rows)
    mrr = per_query_metrics(scores)["mrr_at_10"].mean()
    expected = (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4  # a uniformly random rank of the positive
    assert abs(mrr - expected) < 0.06
    # The same seed gives the same ranks whatever the input order; another seed differs.
    shuffled = scores.sample(frac=1.0, random_state=3)
    key = ["query_id", "doc_id"]
    a = rank_candidates(scores, seed=7).set_index(key)["rank"].sort_index()
    b = rank_candidates(shuffled, seed=7).set_index(key)["rank"].sort_index()
    c = rank_candidates(scores, seed=8).set_index(key)["rank"].sort_index()
    assert a.equals(b)
    assert not a.equals(c)


def test_queries_without_positive_are_left_out_and_counted():
    scores = table([("q1", "a", 1, 0.9), ("q1", "b", 0, 0.1), ("q2", "c", 0, 0.5)])
    result = evaluate_models({"base": scores})
    assert result["models"]["base"]["overall"]["n_queries"] == 1
    assert result["n_queries_without_positive"] == 1


def test_breakdown_by_task_type_and_language():
    scores = table([
        ("q1", "a", 1, 0.9, "t2t", "en"), ("q1", "b", 0, 0.1, "t2t", "en"),  # RR 1
        ("q2", "c", 1, 0.1, "t2i", "en"), ("q2", "d", 0, 0.9, "t2i", "en"),  # RR 1/2
        ("q3", "e", 1, 0.1, "t2i", "zh"), ("q3", "f", 0, 0.5, "t2i", "zh"), ("q3", "g", 0, 0.9, "t2i", "zh"),  # RR 1/3
    ])
    figures = evaluate_models({"base": scores})["models"]["base"]
    assert figures["by_task_type"]["t2t"]["mrr_at_10"] == pytest.approx(1.0)
    assert figures["by_task_type"]["t2i"]["mrr_at_10"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert figures["by_task_type"]["t2i"]["n_queries"] == 2
    assert figures["by_language"]["en"]["mrr_at_10"] == pytest.approx((1 + 1 / 2) / 2)
    assert figures["by_language"]["zh"]["mrr_at_10"] == pytest.approx(1 / 3)


def _two_models(n=20):
    """Base puts each query's positive at rank 2..5; the fine-tuned model always at rank 1."""
    rng = np.random.default_rng(0)
    negatives = ["n0", "n1", "n2", "n3"]
    base_rows, ft_rows = [], []
    for i in range(n):
        at = int(rng.integers(1, 5))  # 0-based position of the positive for base
        for r, d in enumerate(negatives[:at] + ["p"] + negatives[at:]):
            base_rows.append((f"q{i}", d, int(d == "p"), 10.0 - r))
        for r, d in enumerate(["p"] + negatives):
            ft_rows.append((f"q{i}", d, int(d == "p"), 10.0 - r))
    return table(base_rows), table(ft_rows)


def test_paired_comparison_detects_a_consistent_improvement():
    base, ft = _two_models()
    pb, pf = per_query_metrics(base), per_query_metrics(ft)
    cmp = paired_comparison(pb, pf, n_resamples=5000, seed=0)["mrr_at_10"]
    diffs = pf["mrr_at_10"] - pb["mrr_at_10"]
    assert cmp["diff"] == pytest.approx(diffs.mean())
    assert cmp["finetuned"] == 1.0
    assert cmp["p_value"] < 0.01
    assert 0 < cmp["ci_low"] < cmp["diff"] < cmp["ci_high"] <= diffs.max()
    assert cmp["confidence_level"] == 0.95


def test_paired_comparison_of_identical_rankings():
    base, _ = _two_models()
    pb = per_query_metrics(base)
    cmp = paired_comparison(pb, pb.copy(), n_resamples=1000)
    for name in METRIC_NAMES:
        assert cmp[name]["diff"] == 0.0
        assert cmp[name]["p_value"] == 1.0
        assert cmp[name]["ci_low"] == cmp[name]["ci_high"] == 0.0


def test_evaluate_models_from_one_long_table():
    base, ft = _two_models()
    long = pd.concat([base.assign(model="base"), ft.assign(model="stage_1gpu")])
    result = evaluate_models(long, n_resamples=1000)
    assert result["finetuned"] == "stage_1gpu"
    assert set(result["models"]) == {"base", "stage_1gpu"}
    assert result["comparisons"]["stage_1gpu"]["mrr_at_10"]["finetuned"] == 1.0


def test_bad_tables_are_rejected():
    with pytest.raises(ValueError, match="lacks column"):
        rank_candidates(pd.DataFrame({"query_id": ["q"], "doc_id": ["d"], "label": [1]}))
    with pytest.raises(ValueError, match="duplicate candidate"):
        rank_candidates(table([("q", "d", 1, 0.1), ("q", "d", 0, 0.2)]))
    with pytest.raises(ValueError, match="base model"):
        evaluate_models({"other": table([("q", "d", 1, 0.1)])})
