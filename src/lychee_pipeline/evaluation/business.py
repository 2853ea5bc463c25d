"""Offline business proxies of a ranking: expected CTR, expected purchases, long-tail exposure, coverage.

Every figure is computed from a *ranked* scores table (the output of
:func:`lychee_pipeline.evaluation.metrics.rank_candidates`, so ties are broken the same way as for
the ranking metrics), one row per (query, candidate) with ``query_id, doc_id, label, rank`` and,
where the data has them, the document meta fields ``clicks``, ``purchased`` and ``popularity``
(numbers; missing values are NaN). The formulas are written out in ``docs/metrics.md``.

Position-based click model
--------------------------
A user examines rank ``r`` with probability ``e(r)`` and clicks an examined document ``d`` with
probability ``c(d)``, independently: ``P(click at r) = e(r) * c(d_r)``.

* ``e(r)`` is ``1 / log2(r + 1)`` (``"log2"``, default), ``1 / r`` (``"reciprocal"``), or an explicit
  list ``[e(1), e(2), ...]`` (ranks past its end are not examined).
* ``c(d)`` is ``clicks(d) / max clicks among the query's candidates`` when ``d`` has a ``clicks``
  value (0 when that maximum is 0), otherwise ``label(d) / max label in the table``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

Examination = str | Sequence[float]


def examination_probabilities(ranks: Iterable[int] | np.ndarray, examination: Examination = "log2") -> np.ndarray:
    """``e(r)`` for each 1-based rank."""
    r = np.asarray(list(ranks) if not isinstance(ranks, np.ndarray) else ranks, dtype=float)
    if np.any(r < 1):
        raise ValueError("ranks are 1-based")
    if isinstance(examination, str):
        if examination == "log2":
            return 1.0 / np.log2(r + 1.0)
        if examination == "reciprocal":
            return 1.0 / r
        raise ValueError(f"unknown examination model {examination!r}: use 'log2', 'reciprocal' or a list")
    probs = np.asarray(list(examination), dtype=float)
    if probs.ndim != 1 or np.any((probs < 0) | (probs > 1)):
        raise ValueError("an explicit examination list holds probabilities in [0, 1]")
    padded = np.concatenate([probs, [0.0]])  # ranks past the list are not examined
    return padded[np.minimum(r.astype(int) - 1, len(probs))]


def click_probabilities(ranked: pd.DataFrame) -> pd.Series:
    """``c(d)`` per row (see the module text)."""
    max_label = float(ranked["label"].max()) if len(ranked) else 0.0
    from_label = ranked["label"].astype(float) / max_label if max_label > 0 else ranked["label"] * 0.0
    if "clicks" not in ranked.columns or ranked["clicks"].isna().all():
        return from_label.astype(float)
    clicks = ranked["clicks"].astype(float)
    query_max = clicks.groupby(ranked["query_id"]).transform("max")
    from_clicks = (clicks / query_max.where(query_max > 0)).fillna(0.0)
    return from_clicks.where(clicks.notna(), from_label).astype(float)


def _has(ranked: pd.DataFrame, column: str) -> bool:
    return column in ranked.columns and ranked[column].notna().any()


def tail_items(candidates: pd.DataFrame, tail_fraction: float = 0.8) -> set[str]:
    """The least popular ``tail_fraction`` of the catalogue, by ``popularity``.

    The catalogue is every distinct ``doc_id`` among the candidates (its popularity is the first
    non-missing value; documents without one are left out). Documents are sorted by popularity,
    then ``doc_id`` (so equal popularities split reproducibly), and the first
    ``floor(tail_fraction * n)`` are the tail.
    """
    if not 0.0 <= tail_fraction <= 1.0:
        raise ValueError("tail_fraction is a share in [0, 1]")
    if not _has(candidates, "popularity"):
        return set()
    pop = (candidates.dropna(subset=["popularity"]).assign(doc_id=lambda d: d["doc_id"].astype(str))
           .groupby("doc_id")["popularity"].first().reset_index())
    pop = pop.sort_values(["popularity", "doc_id"], kind="stable")
    n_tail = math.floor(tail_fraction * len(pop) + 1e-9)
    return set(pop["doc_id"].iloc[:n_tail])


def business_metrics(
    ranked: pd.DataFrame,
    *,
    k: int = 10,
    examination: Examination = "log2",
    tail: set[str] | None = None,
    tail_fraction: float = 0.8,
) -> dict[str, float | None]:
    """Business proxies of one model's ranking at cut-off ``k`` (means over queries).

    * ``expected_ctr_at_k``: ``mean_q [1 - prod_{r<=k} (1 - e(r) c(d_r))]``, the chance a query gets at
      least one click in its top k.
    * ``expected_clicks_at_k``: ``mean_q sum_{r<=k} e(r) c(d_r)``.
    * ``expected_purchases_at_k``: ``mean_q sum_{r<=k} e(r) purchased(d_r)`` (``None`` without
      ``purchased`` data; missing values count as 0).
    * ``long_tail_share_at_k``: tail items among all top-k slots (``None`` without ``popularity``).
    * ``coverage_at_k``: distinct documents shown in any top k / distinct candidate documents.
    """
    if "rank" not in ranked.columns:
        raise ValueError("business metrics need a ranked table (metrics.rank_candidates)")
    if k < 1:
        raise ValueError("k must be at least 1")
    top = ranked[ranked["rank"] <= k].copy()
    top["exam"] = examination_probabilities(top["rank"].to_numpy(), examination)
    top["click"] = click_probabilities(ranked).loc[top.index]
    p = top["exam"] * top["click"]
    n_q = ranked["query_id"].nunique()
    ctr = (1.0 - (1.0 - p).groupby(top["query_id"]).prod()).sum() / n_q if n_q else float("nan")
    clicks = p.groupby(top["query_id"]).sum().sum() / n_q if n_q else float("nan")
    out: dict[str, float | None] = {
        "expected_ctr_at_k": float(ctr),
        "expected_clicks_at_k": float(clicks),
        "expected_purchases_at_k": None,
        "long_tail_share_at_k": None,
        "coverage_at_k": None,
        "k": k,
    }
    if _has(ranked, "purchased"):
        bought = top["purchased"].astype(float).fillna(0.0)
        out["expected_purchases_at_k"] = float((top["exam"] * bought).groupby(top["query_id"]).sum().sum() / n_q)
    if tail is None:
        tail = tail_items(ranked, tail_fraction)
    if _has(ranked, "popularity") and len(top):
        out["long_tail_share_at_k"] = float(top["doc_id"].astype(str).isin(tail).mean())
    catalogue = ranked["doc_id"].astype(str).nunique()
    if catalogue:
        out["coverage_at_k"] = float(top["doc_id"].astype(str).nunique() / catalogue)
    return out


def uplift(base: float | None, finetuned: float | None) -> dict[str, float | None]:
    """``{"base", "finetuned", "uplift" (absolute), "uplift_rel" (finetuned / base - 1)}``."""
    if base is None or finetuned is None:
        return {"base": base, "finetuned": finetuned, "uplift": None, "uplift_rel": None}
    rel = finetuned / base - 1.0 if base != 0 else None
    return {"base": base, "finetuned": finetuned, "uplift": finetuned - base, "uplift_rel": rel}


DEFAULT_KS = (5, 10)  # cut-offs of the business metrics unless evaluation.business.ks names others


def compare_business(
    ranked_by_model: Mapping[str, pd.DataFrame],
    *,
    base: str = "base",
    finetuned: str | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    examination: Examination = "log2",
    tail_fraction: float = 0.8,
) -> dict[str, Any]:
    """Business metrics of every model at every ``k``, and base vs fine-tuned with uplift.

    The tail set is taken once from the base table, so every model is judged on the same catalogue.
    Keys are ``<metric>@<k>`` with ``_at_k`` spelled out: ``expected_ctr_at_10`` and so on.
    """
    if base not in ranked_by_model:
        raise ValueError(f"no ranking for the base model {base!r}")
    tail = tail_items(ranked_by_model[base], tail_fraction)
    models: dict[str, dict[str, float | None]] = {}
    for name, table in ranked_by_model.items():
        figures: dict[str, float | None] = {}
        for k in ks:
            for key, value in business_metrics(table, k=k, examination=examination, tail=tail).items():
                if key != "k":
                    figures[key.replace("_at_k", f"_at_{k}")] = value
        models[name] = figures
    headline = finetuned if finetuned is not None else next((m for m in reversed(list(models)) if m != base), None)
    comparison = (
        {key: uplift(models[base][key], models[headline][key]) for key in models[base]} if headline else {}
    )
    return {
        "base": base,
        "finetuned": headline,
        "ks": list(ks),
        "examination": examination if isinstance(examination, str) else list(examination),
        "tail_fraction": tail_fraction,
        "n_tail_items": len(tail),
        "models": models,
        "comparison": comparison,
    }
