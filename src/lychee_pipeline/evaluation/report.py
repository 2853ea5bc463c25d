"""The evaluation report: one metrics document (JSON), a Markdown report, PNG plots, MLflow metrics.

Plots are ``matplotlib.figure.Figure`` objects built without pyplot, so no GUI backend and no global
figure state is involved; saving them as PNG goes through Agg.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lychee_pipeline.evaluation.metrics import METRIC_NAMES
from lychee_pipeline.evaluation.scaling import PARENT_RUN_FIELDS, STAGE_RUN_FIELDS, ScalingReport, ScalingRow

METRIC_LABELS = {
    "mrr_at_10": "MRR@10",
    "ndcg_at_10": "NDCG@10",
    "recall_at_1": "Recall@1",
    "recall_at_5": "Recall@5",
    "recall_at_10": "Recall@10",
    "map": "MAP",
}
PLOT_FILES = ("loss_curves.png", "learning_rates.png", "metric_bars.png", "task_type_bars.png", "scaling.png")


# --------------------------------------------------------------------------- losses


def loss_points(losses: Any) -> list[tuple[float, float]]:
    """Normalise a stage's losses to ``[(step, loss), ...]``.

    Accepts pairs ``(step, loss)``, dicts with ``step`` and ``loss``, or bare numbers (step = 1, 2, ...).
    """
    points: list[tuple[float, float]] = []
    for i, item in enumerate(losses or []):
        if isinstance(item, Mapping):
            points.append((float(item.get("step", i + 1)), float(item["loss"])))
        elif isinstance(item, Sequence) and not isinstance(item, str):
            points.append((float(item[0]), float(item[1])))
        else:
            points.append((float(i + 1), float(item)))
    return points


def training_summary(stage_losses: Mapping[str, Any]) -> dict[str, dict[str, float | int | None]]:
    """Per stage: number of logged steps, first and final loss."""
    out: dict[str, dict[str, float | int | None]] = {}
    for stage, losses in stage_losses.items():
        pts = loss_points(losses)
        out[stage] = {
            "n_points": len(pts),
            "first_loss": pts[0][1] if pts else None,
            "final_loss": pts[-1][1] if pts else None,
            "last_step": pts[-1][0] if pts else None,
        }
    return out


# --------------------------------------------------------------------------- document


def build_metrics_document(
    ranking: Mapping[str, Any],
    business: Mapping[str, Any],
    scaling: ScalingReport | None,
    stage_losses: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the report shows, in one JSON-ready dict (the scaling report as its fields)."""
    return {
        "ranking": dict(ranking),
        "business": dict(business),
        "scaling": scaling.model_dump() if scaling is not None else None,
        "training": training_summary(stage_losses or {}),
    }


def document_scaling(document: Mapping[str, Any]) -> ScalingReport | None:
    """The document's scaling report, typed again (the document is plain JSON)."""
    scaling = document.get("scaling")
    return ScalingReport.model_validate(scaling) if scaling is not None else None


def _key(part: Any) -> str:
    return re.sub(r"[^0-9A-Za-z_\-]", "_", str(part))


def _num(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def stage_metric_name(group: str, field: str, stage: str | None = None) -> str:
    """A stage's figure in MLflow: ``<group>.<stage>.<field>`` on the parent run, ``<group>.<field>`` on the
    stage's own nested run (``stage`` None). The one place these names are made."""
    return f"{group}.{_key(stage)}.{field}" if stage is not None else f"{group}.{field}"


def scaling_row_metrics(row: ScalingRow, on_stage_run: bool = False) -> dict[str, float]:
    """A scaling row's figures under their MLflow names: every figure on the parent run, the stage's own
    training figures (no test figure) on its nested run. Missing values are left out."""
    fields = STAGE_RUN_FIELDS if on_stage_run else PARENT_RUN_FIELDS
    named = {stage_metric_name("scaling", f, None if on_stage_run else row.stage): _num(getattr(row, f))
             for f in fields}
    return {name: value for name, value in named.items() if value is not None}


def final_loss_metric(stage: str, losses: Any, on_stage_run: bool = False) -> dict[str, float]:
    """``training[.<stage>].final_loss``: the last logged loss of the stage (none when it logged none)."""
    value = _num(training_summary({stage: losses})[stage]["final_loss"])
    return {stage_metric_name("training", "final_loss", None if on_stage_run else stage): value} \
        if value is not None else {}


def stage_run_metrics(row: ScalingRow | None, stage: str, losses: Any) -> dict[str, float]:
    """What a stage's nested MLflow run gets: its scaling row's training figures and its final loss."""
    return {**(scaling_row_metrics(row, on_stage_run=True) if row is not None else {}),
            **final_loss_metric(stage, losses, on_stage_run=True)}


def mlflow_metrics(document: Mapping[str, Any], prefix: str = "test") -> dict[str, float]:
    """A flat ``{name: float}`` of every numeric figure, with MLflow-safe names.

    ``test.<metric>.<model>`` for each model (``base``, every stage, and ``finetuned`` for the
    headline one), ``test.<metric>.{diff,ci_low,ci_high,p_value}`` for the headline comparison
    (``test.<metric>.<stage>.diff`` ... for every compared stage),
    ``test.by_<attr>.<group>.<metric>.<model>``, ``business.<metric>.{base,finetuned,uplift,uplift_rel}``,
    ``scaling.<stage>.<field>`` and ``training.<stage>.final_loss``. Missing values are left out.
    """
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        v = _num(value)
        if v is not None:
            out[name] = v

    ranking = document.get("ranking") or {}
    headline = ranking.get("finetuned")
    for model, figures in (ranking.get("models") or {}).items():
        aliases = [_key(model)] + (["finetuned"] if model == headline else [])
        for alias in aliases:
            for metric, value in figures["overall"].items():
                put(f"{prefix}.{metric}.{alias}", value)
            for attr in ("task_type", "language"):
                for group, values in (figures.get(f"by_{attr}") or {}).items():
                    for metric, value in values.items():
                        put(f"{prefix}.by_{attr}.{_key(group)}.{metric}.{alias}", value)
    for model, comparison in (ranking.get("comparisons") or {}).items():
        for metric, row in comparison.items():
            for field in ("diff", "ci_low", "ci_high", "p_value"):
                put(f"{prefix}.{metric}.{_key(model)}.{field}", row.get(field))
                if model == headline:
                    put(f"{prefix}.{metric}.{field}", row.get(field))
    business = document.get("business") or {}
    for metric, row in (business.get("comparison") or {}).items():
        for field, value in row.items():
            put(f"business.{metric}.{field}", value)
    for model, figures in (business.get("models") or {}).items():
        for metric, value in figures.items():
            put(f"business.{metric}.{_key(model)}", value)
    scaling = document_scaling(document)
    for row in scaling.rows if scaling is not None else []:
        out.update(scaling_row_metrics(row))
    for stage, summary in (document.get("training") or {}).items():
        put(stage_metric_name("training", "final_loss", stage), summary.get("final_loss"))
    return out


# --------------------------------------------------------------------------- Markdown


def _fmt(value: Any, digits: int = 4) -> str:
    v = _num(value)
    if v is None:
        return "–"
    return f"{v:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def trivial_recalls(ranking: Mapping[str, Any]) -> list[str]:
    """The Recall@k measures that are 1 for any model: every query has at most k candidates."""
    most = ranking.get("max_candidates_per_query")
    if not most:
        return []
    return [m for m in METRIC_NAMES if m.startswith("recall_at_") and int(m.rsplit("_", 1)[1]) >= most]


def has_scaling_plot(scaling: ScalingReport | None) -> bool:
    """A scaling plot needs stages on two device counts at least: one point has no slope to compare."""
    return scaling is not None and len({r.devices for r in scaling.rows}) >= 2


def plot_files(document: Mapping[str, Any]) -> list[str]:
    return [n for n in PLOT_FILES if n != "scaling.png" or has_scaling_plot(document_scaling(document))]


def render_markdown(document: Mapping[str, Any], plots_dir: str = "plots") -> str:
    """The human-readable report; plots are linked relative to the report's folder."""
    ranking = document.get("ranking") or {}
    models = ranking.get("models") or {}
    base, headline = ranking.get("base"), ranking.get("finetuned")
    lines = ["# Evaluation report", ""]
    lines += [
        f"Ranking measures: {ranking.get('library', '?')}; candidates shuffled with seed {ranking.get('seed')} "
        "before a stable sort by score, so ties are broken at random but reproducibly.",
        "",
        f"Base model: `{base}`; headline fine-tuned model: `{headline}`.",
        "",
        "## Ranking quality (test split)",
        "",
    ]
    trivial = trivial_recalls(ranking)

    def cell(metric: str, value: Any, digits: int = 4) -> str:
        return "trivial" if metric in trivial else _fmt(value, digits)

    lines += _table(
        ["model", "queries"] + [METRIC_LABELS[m] for m in METRIC_NAMES],
        [[m, f["overall"]["n_queries"]] + [cell(k, f["overall"][k]) for k in METRIC_NAMES] for m, f in models.items()],
    )
    if trivial:
        most = ranking.get("max_candidates_per_query")
        lines += ["", f"{', '.join(METRIC_LABELS[m] for m in trivial)}: every test query has at most {most} "
                  "candidates, so every relevant candidate is always in the top k and the recall is 1.0 for any "
                  "model; it says nothing here (shown as *trivial*). Compare MRR@10, NDCG@10 and MAP instead."]
    if ranking.get("n_queries_without_positive"):
        lines += ["", f"{ranking['n_queries_without_positive']} test queries had no relevant candidate and were left out."]
    for model, comparison in (ranking.get("comparisons") or {}).items():
        level = next(iter(comparison.values()), {}).get("confidence_level", 0.95)
        lines += ["", f"### `{model}` vs `{base}` (paired over queries)", ""]
        lines += _table(
            ["measure", "base", "fine-tuned", "difference", f"{100 * level:.0f}% CI of difference", "p-value"],
            [[METRIC_LABELS[k], cell(k, r["base"]), cell(k, r["finetuned"]), cell(k, r["diff"]),
              "–" if k in trivial else f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]",
              cell(k, r["p_value"])] for k, r in comparison.items()],
        )
    for attr, title in (("task_type", "task type"), ("language", "query language")):
        groups = sorted({g for f in models.values() for g in (f.get(f"by_{attr}") or {})})
        if not groups:
            continue
        lines += ["", f"## MRR@10 and NDCG@10 by {title}", ""]
        rows = []
        for g in groups:
            row: list[Any] = [g]
            for m, f in models.items():
                cell = (f.get(f"by_{attr}") or {}).get(g)
                row.append(f"{_fmt(cell['mrr_at_10'])} / {_fmt(cell['ndcg_at_10'])} (n={cell['n_queries']})"
                           if cell else "–")
            rows.append(row)
        lines += _table([title] + list(models), rows)
    business = document.get("business") or {}
    if business.get("comparison"):
        exam = business.get("examination")
        lines += [
            "", "## Business proxies", "",
            f"Position-based click model, examination `{exam}`; tail = least popular "
            f"{100 * business.get('tail_fraction', 0.8):.0f}% of the candidate catalogue "
            f"({business.get('n_tail_items')} items). Formulas: docs/metrics.md.", "",
        ]
        lines += _table(
            ["metric", "base", "fine-tuned", "uplift", "relative uplift"],
            [[k, _fmt(r["base"]), _fmt(r["finetuned"]), _fmt(r["uplift"]),
              (f"{100 * r['uplift_rel']:+.1f}%" if _num(r["uplift_rel"]) is not None else "–")]
             for k, r in business["comparison"].items()],
        )
        if any(k.startswith("expected_purchases") for k in business["comparison"]):
            lines += ["", "`expected_purchases@k` is in the units of the documents' `purchased` field, summed over "
                      "the top k with each position's examination probability and averaged over queries: with 0/1 "
                      "flags it is the expected number of purchased items a user of one query sees in the top k; "
                      "with counts (the demo data: historical purchases per product) it is an examination-weighted "
                      "count per query, to compare models with, not a forecast of sales."]
    scaling = document_scaling(document)
    lines += ["", "## Scaling", ""]
    if scaling is not None and scaling.rows:
        lines += [f"Full training set: {scaling.full_train_pairs} pairs.", ""]
        lines += _table(
            ["stage", "devices", "wall time (s)", "pairs/s (timed steps)", "efficiency", "peak mem/device (GiB)",
             "epoch (h)", "device-h/epoch", "relative device-h", "MRR@10"],
            [[r.stage, r.label, _fmt(r.wall_time_s, 1),
              _fmt(r.pairs_per_s, 2) + (f" (steps {r.window[0]}-{r.window[1]})" if r.window
                                        else f" ({r.rate_steps})"),
              (f"{100 * r.scaling_efficiency:.0f}%" if _num(r.scaling_efficiency) is not None
               else "not comparable" if r.not_comparable else "–"),
              ", ".join(f"{m:.2f}" for m in r.peak_mem_gib) or "–",
              _fmt(r.epoch_time_s / 3600 if _num(r.epoch_time_s) is not None else None, 3),
              _fmt(r.device_hours_per_epoch, 3), _fmt(r.relative_device_hours, 2), _fmt(r.mrr_at_10)]
             for r in scaling.rows],
        )
        lines += [f"{r.stage}: efficiency not comparable: {r.not_comparable}." for r in scaling.rows if r.not_comparable]
        lines += ["", scaling.summary]
    else:
        lines += ["No training stage ran."]
    training = document.get("training") or {}
    if training:
        lines += ["", "## Training losses", ""]
        lines += _table(["stage", "points", "first loss", "final loss"],
                        [[s, t["n_points"], _fmt(t["first_loss"]), _fmt(t["final_loss"])] for s, t in training.items()])
    lines += ["", "## Plots", ""]
    lines += [f"![{name[:-4]}]({plots_dir}/{name})" for name in plot_files(document)]
    if "scaling.png" not in plot_files(document):
        lines += ["", "No scaling plot: it needs stages on at least two device counts."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _figure(width: float = 8.0, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _plot_stage_series(series: Mapping[str, Any], ylabel: str, title: str, nothing: str) -> Figure:
    """One line per stage of ``[step, value]`` points (losses, learning rates)."""
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for stage, values in series.items():
        pts = loss_points(values)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None, label=stage)
            drawn = True
    if drawn:
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend()
        ax.grid(alpha=0.3)
    else:
        _empty(ax, nothing)
    return fig


def plot_loss_curves(stage_losses: Mapping[str, Any]) -> Figure:
    """Training loss against step, one line per stage."""
    return _plot_stage_series(stage_losses, "training loss", "Training loss per stage", "no training losses recorded")


def plot_learning_rates(stage_learning_rates: Mapping[str, Any]) -> Figure:
    """The learning rate in force after each optimizer step, one line per stage: one warm-up and one decay each."""
    return _plot_stage_series(stage_learning_rates, "learning rate", "Learning-rate schedule per stage",
                              "no learning rates recorded")


def _grouped_bars(ax: Any, groups: Sequence[str], series: Mapping[str, Sequence[float]]) -> None:
    x = np.arange(len(groups))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        vals = [v if _num(v) is not None else 0.0 for v in values]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x, groups)
    ax.set_ylim(0, 1.12)
    if series:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)


def plot_metric_bars(ranking: Mapping[str, Any]) -> Figure:
    """Every ranking measure, one bar per model."""
    fig = _figure(9.0, 4.5)
    ax = fig.add_subplot()
    models = ranking.get("models") or {}
    if not models:
        _empty(ax, "no models were evaluated")
        return fig
    series = {m: [f["overall"][k] for k in METRIC_NAMES] for m, f in models.items()}
    _grouped_bars(ax, [METRIC_LABELS[k] for k in METRIC_NAMES], series)
    ax.set(title="Ranking quality on the test split", ylabel="score")
    return fig


def plot_task_type_bars(ranking: Mapping[str, Any], metric: str = "mrr_at_10") -> Figure:
    """One measure per task type, one bar per model."""
    fig = _figure()
    ax = fig.add_subplot()
    models = ranking.get("models") or {}
    groups = sorted({g for f in models.values() for g in (f.get("by_task_type") or {})})
    if not groups:
        _empty(ax, "no task types in the test data")
        return fig
    series = {m: [((f.get("by_task_type") or {}).get(g) or {}).get(metric) for g in groups] for m, f in models.items()}
    _grouped_bars(ax, groups, series)
    ax.set(title=f"{METRIC_LABELS.get(metric, metric)} by task type", ylabel=METRIC_LABELS.get(metric, metric))
    return fig


def plot_scaling(scaling: ScalingReport | None) -> Figure:
    """Throughput against devices (with ideal linear scaling) and scaling efficiency."""
    fig = _figure(10.0, 4.0)
    rows = scaling.rows if scaling is not None else []
    if not rows:
        _empty(fig.add_subplot(), "no training stage ran")
        return fig
    ax1, ax2 = fig.subplots(1, 2)
    for device_type in sorted({r.device_type for r in rows}):
        group = sorted((r for r in rows if r.device_type == device_type), key=lambda r: r.devices)
        kind = "GPUs" if device_type == "cuda" else "CPU processes"
        n = [r.devices for r in group]
        rates = [r.pairs_per_s if r.pairs_per_s is not None else float("nan") for r in group]
        ax1.plot(n, rates, marker="o", label=f"measured ({kind})")
        per_device = rates[0] / group[0].devices
        ax1.plot(n, [per_device * d for d in n], linestyle="--", label=f"linear ({kind})")
        ax2.bar([f"{r.label}\n{r.stage}" + ("\n(not comparable)" if r.not_comparable else "") for r in group],
                [100 * (r.scaling_efficiency or 0.0) for r in group])
    ax1.set(xlabel="devices", ylabel="pairs / s", title="Training throughput")
    ax1.set_xticks(sorted({r.devices for r in rows}))
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.axhline(100, color="grey", linestyle="--", linewidth=1)
    ax2.set(ylabel="scaling efficiency (%)", title="Efficiency vs the smallest device count")
    return fig


def build_plots(
    document: Mapping[str, Any], stage_losses: Mapping[str, Any], stage_learning_rates: Mapping[str, Any] | None = None
) -> dict[str, Figure]:
    """``{file name: figure}`` for the plots in :data:`PLOT_FILES`."""
    ranking = document.get("ranking") or {}
    return {
        "loss_curves.png": plot_loss_curves(stage_losses),
        "learning_rates.png": plot_learning_rates(stage_learning_rates or {}),
        "metric_bars.png": plot_metric_bars(ranking),
        "task_type_bars.png": plot_task_type_bars(ranking),
        **({"scaling.png": plot_scaling(scaling)} if has_scaling_plot(scaling := document_scaling(document)) else {}),
    }


def figure_png(fig: Figure, dpi: int = 120) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
