"""Ranking quality of a reranker on a scored test set, computed with ``ir_measures``.

Input is a *long* scores table, one row per (query, candidate):

``query_id, doc_id, label, score, task_type, language`` (extra columns are kept and ignored).

``label`` is the relevance (0/1 or graded, larger is better); ``task_type`` and ``language`` are per
query attributes (the same on every row of a query).

Ranking and ties
----------------
Each query's candidates are shuffled with a fixed seed before ranking: every candidate gets the
pseudo-random key ``blake2b(seed, query_id, doc_id)`` (64 bits), which orders them at random but
reproducibly, independent of the input order and of the other queries in the table. They are then
sorted by score, highest first, and candidates with equal scores keep their shuffled order. So ties
are broken at random, and the order the candidates arrived in can neither help nor change the
result. The library is then given the rank (as the score ``-rank``), so its own tie-breaking
(trec_eval sorts ties by document id) never comes into play.

Library
-------
The measures come from ``ir_measures`` with its providers pinned: pytrec_eval (trec_eval) for
``nDCG@10``, ``R@1``, ``R@5``, ``R@10`` and ``AP``, and ir_measures' MS MARCO implementation for
``RR@10`` (trec_eval's ``recip_rank`` has no cut-off: forced through pytrec_eval, ``RR@10`` would
silently count a first relevant document at rank 11). These were chosen over ranx because ranx
compiles its measures with numba on first use, which costs tens of seconds per fresh process on a
small machine; the values agree. Relevance for RR, recall and AP means ``label >= 1``; nDCG uses the label itself
as the gain (trec_eval's linear gain). Queries without any relevant candidate are left out of every
measure (their count is reported).

Significance
------------
Fine-tuned against base is a paired comparison over the same queries: the p-value is a two-sided
paired randomisation (sign-flip) test on the per-query differences
(``scipy.stats.permutation_test``, ``permutation_type="samples"``), and the interval is a percentile
bootstrap over queries of the mean difference (``scipy.stats.bootstrap``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import ir_measures
import numpy as np
import pandas as pd
from ir_measures import AP, RR, R, nDCG
from scipy import stats

#: Output name -> ir_measures measure. The order is the order of every table and plot.
#: Each measure is computed by the provider named in :data:`PROVIDERS`.
MEASURES: dict[str, Any] = {
    "mrr_at_10": RR @ 10,
    "ndcg_at_10": nDCG @ 10,
    "recall_at_1": R @ 1,
    "recall_at_5": R @ 5,
    "recall_at_10": R @ 10,
    "map": AP,
}
METRIC_NAMES: tuple[str, ...] = tuple(MEASURES)
PROVIDERS: dict[str, str] = {
    "mrr_at_10": "msmarco",
    "ndcg_at_10": "pytrec_eval",
    "recall_at_1": "pytrec_eval",
    "recall_at_5": "pytrec_eval",
    "recall_at_10": "pytrec_eval",
    "map": "pytrec_eval",
}

REQUIRED_COLUMNS = ("query_id", "doc_id", "label", "score")
QUERY_ATTRIBUTES = ("task_type", "language")


def _check(scores: pd.DataFrame) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in scores.columns]
    if missing:
        raise ValueError(f"scores table lacks column(s) {missing}; it has {list(scores.columns)}")
    if scores.duplicated(["query_id", "doc_id"]).any():
        dup = scores.loc[scores.duplicated(["query_id", "doc_id"]), ["query_id", "doc_id"]].iloc[0]
        raise ValueError(f"duplicate candidate {dup['doc_id']!r} in query {dup['query_id']!r}")
    if scores["score"].isna().any():
        raise ValueError("scores table has missing scores")


def query_rng(seed: int, query_id: str) -> np.random.Generator:
    """A generator for one query (stable across tables and processes), e.g. to order its candidates."""
    return np.random.default_rng([int(seed), zlib.crc32(str(query_id).encode("utf-8"))])


def tie_keys(query_ids: pd.Series, doc_ids: pd.Series, seed: int = 0) -> np.ndarray:
    """A pseudo-random 64-bit key per (seed, query, candidate): the seeded shuffle that breaks ties."""
    prefix = f"{int(seed)}\x1f".encode()
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(prefix + f"{q}\x1f{d}".encode("utf-8"), digest_size=8).digest(), "big")
         for q, d in zip(query_ids.astype(str), doc_ids.astype(str), strict=True)),
        dtype=np.uint64, count=len(query_ids),
    )


def rank_candidates(scores: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Return ``scores`` with a 1-based ``rank`` per query (see the module text for ties).

    Rows come back ordered by query (first appearance) and rank.
    """
    _check(scores)
    if not len(scores):
        return scores.assign(rank=pd.Series(dtype="int64"))
    query = scores["query_id"].astype(str)
    query_order = pd.factorize(query)[0]
    order = np.lexsort((
        scores["doc_id"].astype(str).to_numpy(),          # last resort: a (vanishingly rare) key collision
        tie_keys(query, scores["doc_id"], seed),          # the seeded shuffle
        -scores["score"].to_numpy(dtype=float),           # highest score first
        query_order,
    ))
    ranked = scores.iloc[order].reset_index(drop=True)
    ranked["rank"] = ranked.groupby(pd.factorize(ranked["query_id"].astype(str))[0]).cumcount() + 1
    return ranked


def per_query_metrics(scores: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """One row per query (with at least one relevant candidate): every measure plus its attributes.

    The index is ``query_id``; columns are :data:`METRIC_NAMES` then ``task_type`` and ``language``
    where the table has them.
    """
    ranked = rank_candidates(scores, seed)
    relevant_queries = ranked.loc[ranked["label"] >= 1, "query_id"].unique()
    ranked = ranked[ranked["query_id"].isin(relevant_queries)]
    qrels = pd.DataFrame(
        {
            "query_id": ranked["query_id"].astype(str),
            "doc_id": ranked["doc_id"].astype(str),
            "relevance": ranked["label"].astype(int),
        }
    )
    run = pd.DataFrame(
        {
            "query_id": ranked["query_id"].astype(str),
            "doc_id": ranked["doc_id"].astype(str),
            "score": -ranked["rank"].astype(float),
        }
    )
    by_measure = {m: name for name, m in MEASURES.items()}
    values: dict[str, dict[str, float]] = {}
    if len(run):
        for provider in sorted(set(PROVIDERS.values())):
            measures = [MEASURES[name] for name in METRIC_NAMES if PROVIDERS[name] == provider]
            evaluator = getattr(ir_measures, provider).evaluator(measures, qrels)
            for metric in evaluator.iter_calc(run):
                values.setdefault(metric.query_id, {})[by_measure[metric.measure]] = float(metric.value)
    table = pd.DataFrame.from_dict(values, orient="index", columns=list(METRIC_NAMES))
    table.index = table.index.astype(str)
    table.index.name = "query_id"
    attrs = [a for a in QUERY_ATTRIBUTES if a in ranked.columns]
    if attrs:
        first = ranked.assign(query_id=ranked["query_id"].astype(str)).groupby("query_id")[attrs].first()
        table = table.join(first)
    order = pd.Index(pd.unique(ranked["query_id"].astype(str)))
    return table.reindex(order.intersection(table.index, sort=False))


def summarize(per_query: pd.DataFrame) -> dict[str, float]:
    """Mean of every measure over the queries, and ``n_queries``."""
    out: dict[str, float] = {name: float(per_query[name].mean()) if len(per_query) else float("nan")
                             for name in METRIC_NAMES}
    out["n_queries"] = int(len(per_query))
    return out


def breakdown(per_query: pd.DataFrame, by: str) -> dict[str, dict[str, float]]:
    """:func:`summarize` per value of the query attribute ``by`` (``task_type`` or ``language``)."""
    if by not in per_query.columns:
        return {}
    return {str(key): summarize(group) for key, group in per_query.groupby(by, sort=True)}


def _mean_diff(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(y - x, axis=axis)


def paired_comparison(
    base: pd.DataFrame,
    finetuned: pd.DataFrame,
    *,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per measure: base and fine-tuned means, their difference, a paired p-value and a CI.

    Both tables come from :func:`per_query_metrics`; only queries present in both are compared.
    ``ci_low``/``ci_high`` bound the mean per-query difference (fine-tuned minus base); they are
    ``None`` with fewer than two queries, and equal to the difference when every query moved alike.
    """
    common = base.index.intersection(finetuned.index, sort=False)
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(METRIC_NAMES):
        x = base.loc[common, name].to_numpy(dtype=float)
        y = finetuned.loc[common, name].to_numpy(dtype=float)
        diff = y - x
        row: dict[str, Any] = {
            "base": float(x.mean()) if len(x) else None,
            "finetuned": float(y.mean()) if len(y) else None,
            "diff": float(diff.mean()) if len(diff) else None,
            "n_queries": int(len(common)),
            "p_value": None,
            "ci_low": None,
            "ci_high": None,
            "confidence_level": confidence_level,
            "test": "paired randomisation (sign-flip), two-sided",
        }
        if len(common) >= 2:
            perm = stats.permutation_test(
                (x, y), _mean_diff, permutation_type="samples", n_resamples=n_resamples,
                vectorized=True, alternative="two-sided", random_state=np.random.default_rng([seed, i]),
            )
            row["p_value"] = float(min(1.0, perm.pvalue))
            if np.allclose(diff, diff[0]):
                # Every query moved alike: the bootstrap distribution is a single point.
                row["ci_low"] = row["ci_high"] = float(diff[0])
            else:
                boot = stats.bootstrap(
                    (diff,), np.mean, n_resamples=n_resamples, confidence_level=confidence_level,
                    method="percentile", random_state=np.random.default_rng([seed, i, 1]),
                )
                row["ci_low"] = float(boot.confidence_interval.low)
                row["ci_high"] = float(boot.confidence_interval.high)
        out[name] = row
    return out


def evaluate_models(
    scores: pd.DataFrame | Mapping[str, pd.DataFrame],
    *,
    base: str = "base",
    finetuned: str | Sequence[str] | None = None,
    seed: int = 0,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
) -> dict[str, Any]:
    """Every ranking figure for several models scored on the same candidates.

    ``scores`` is either one table with a ``model`` column, or ``{model: table}``. ``finetuned`` names
    the model(s) compared with ``base`` (default: every other model); the last of them is the
    headline "fine-tuned" model.

    Returns ``{"models": {model: {"overall", "by_task_type", "by_language"}}, "comparisons":
    {model: paired_comparison(base, model)}, "base": base, "finetuned": headline, "n_queries_without_positive"}``.
    """
    if isinstance(scores, pd.DataFrame):
        tables = {str(name): group for name, group in scores.groupby("model", sort=False)}
    else:
        tables = dict(scores)
    if base not in tables:
        raise ValueError(f"no scores for the base model {base!r}; models: {list(tables)}")
    if finetuned is None:
        compared = [m for m in tables if m != base]
    elif isinstance(finetuned, str):
        compared = [finetuned]
    else:
        compared = list(finetuned)
    per_query = {name: per_query_metrics(table, seed) for name, table in tables.items()}
    all_queries = tables[base]["query_id"].astype(str).unique()
    out: dict[str, Any] = {
        "library": f"ir_measures {ir_measures.__version__} (RR@10: msmarco provider; others: pytrec_eval)",
        "seed": seed,
        "base": base,
        "finetuned": compared[-1] if compared else None,
        "n_queries_without_positive": int(len(all_queries) - len(per_query[base])),
        # Recall@k is 1 by construction for every k >= this: the report says so instead of showing it as a result
        "max_candidates_per_query": int(tables[base].groupby("query_id").size().max()) if len(tables[base]) else 0,
        "models": {
            name: {
                "overall": summarize(pq),
                "by_task_type": breakdown(pq, "task_type"),
                "by_language": breakdown(pq, "language"),
            }
            for name, pq in per_query.items()
        },
        "comparisons": {
            name: paired_comparison(per_query[base], per_query[name], n_resamples=n_resamples,
                                    confidence_level=confidence_level, seed=seed)
            for name in compared
        },
    }
    return out
