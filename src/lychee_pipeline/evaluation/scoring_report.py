"""The scoring figures in the report and in MLflow: time per model, pairs/s, sampled and reused scores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HEADING = "## Ranking quality (test split)"


def sampled_note(scoring: Mapping[str, Any] | None) -> str | None:
    """One sentence naming the models whose figures are on a sample of the test queries, or None."""
    models = (scoring or {}).get("models") or {}
    sampled = [(name, m) for name, m in models.items() if m.get("sampled")]
    if not sampled:
        return None
    names = ", ".join(f"`{name}`" for name, _ in sampled)
    first = sampled[0][1]
    return (f"**Sampled figures:** {names} (check stages, scored as gates) are measured on a fixed sample of "
            f"{first['queries']} of the {first['test_queries']} test queries (seed {scoring.get('seed')}), "
            "not the whole split (in the ranking and scaling tables alike); their comparisons with the base model "
            "are paired over those queries only.")


def scoring_markdown(scoring: Mapping[str, Any] | None) -> list[str]:
    """The report's "Scoring" section: per model, queries, pairs, processes, seconds, pairs/s, source."""
    models = (scoring or {}).get("models") or {}
    if not models:
        return []
    lines = ["", "## Scoring", "",
             f"Scoring on {scoring.get('processes')} process(es), device {scoring.get('device_type')}; "
             "seconds include loading the model, pairs/s is the scoring rate of the slowest shard.", "",
             "| model | queries | pairs | processes | seconds | pairs/s | scores |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in models.items():
        queries = f"{m['queries']} of {m['test_queries']} (sampled)" if m.get("sampled") else str(m["queries"])
        source = (f"reused from the score cache (`{str(m.get('cache_key'))[:12]}`)" if m.get("reused")
                  else "computed" + (f", cached as `{str(m['cache_key'])[:12]}`" if m.get("cache_key") else ""))
        seconds = "-" if m.get("reused") else f"{m.get('seconds') or 0:.1f}"
        rate = f"{m['pairs_per_s']:.1f}" if m.get("pairs_per_s") else "-"
        lines.append(f"| {name} | {queries} | {m['pairs']} | {m.get('processes') or '-'} | {seconds} | {rate} | {source} |")
    return lines


def add_scoring(markdown: str, scoring: Mapping[str, Any] | None) -> str:
    """The report with the sampled-figures note under the ranking heading and the Scoring section at the end."""
    note = sampled_note(scoring)
    if note and HEADING in markdown:
        markdown = markdown.replace(HEADING + "\n\n", f"{HEADING}\n\n{note}\n\n", 1)
    section = scoring_markdown(scoring)
    return markdown.rstrip("\n") + "\n" + "\n".join(section) + "\n" if section else markdown


def scoring_mlflow_metrics(scoring: Mapping[str, Any] | None) -> dict[str, float]:
    """``eval.<model>.{seconds,pairs_per_s,pairs,queries,processes,reused,sampled}`` (missing values left out)."""
    out: dict[str, float] = {}
    for name, m in ((scoring or {}).get("models") or {}).items():
        key = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(name))
        for field in ("seconds", "pairs_per_s", "pairs", "queries", "processes"):
            if isinstance(m.get(field), (int, float)) and not isinstance(m.get(field), bool):
                out[f"eval.{key}.{field}"] = float(m[field])
        out[f"eval.{key}.reused"] = float(bool(m.get("reused")))
        out[f"eval.{key}.sampled"] = float(bool(m.get("sampled")))
    return out
