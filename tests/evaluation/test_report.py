"""The report: metrics document, Markdown, PNG plots that decode, and the flat MLflow metrics."""

from __future__ import annotations

import io
import json

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from stage_results import make_result

from lychee_pipeline.evaluation import (
    METRIC_NAMES,
    build_metrics_document,
    build_plots,
    compare_business,
    evaluate_models,
    figure_png,
    mlflow_metrics,
    rank_candidates,
    render_markdown,
    scaling_report,
)
from lychee_pipeline.evaluation.report import PLOT_FILES, loss_points


def _scores():
    rng = np.random.default_rng(1)
    rows = []
    for q in range(24):
        task, lang = ("t2t", "t2i", "i2i")[q % 3], ("en", "zh")[q % 2]
        for d in range(6):
            label = int(d == 0)
            meta = {"clicks": float(rng.integers(0, 20)), "purchased": float(d == 0 and q % 2 == 0),
                    "popularity": float(rng.integers(1, 1000))}
            for model, lift in (("base", 0.0), ("stage_1gpu", 0.8), ("stage_2gpu", 1.5)):
                rows.append({"model": model, "query_id": f"q{q}", "doc_id": f"d{q}_{d}", "label": label,
                             "score": float(rng.normal() + lift * label), "task_type": task, "language": lang,
                             **meta})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def document():
    scores = _scores()
    ranking = evaluate_models(scores, n_resamples=500)
    ranked = {m: rank_candidates(g) for m, g in scores.groupby("model", sort=False)}
    business = compare_business(ranked, ks=[5, 10])
    stages = [
        make_result(stage="stage_1gpu", devices=1, device_type="cuda", wall_time_s=100.0, train_pairs=1000,
                    pairs_per_s=10.0, peak_mem_gib=[30.0], steps=100, step_seconds=[]),
        make_result(stage="stage_2gpu", devices=2, device_type="cuda", wall_time_s=55.0, train_pairs=1000,
                    pairs_per_s=18.0, peak_mem_gib=[31.0, 30.5], steps=100, step_seconds=[]),
    ]
    mrr = {"stage_1gpu": ranking["models"]["stage_1gpu"]["overall"]["mrr_at_10"]}
    losses = {"stage_1gpu": [(1, 2.0), (2, 1.2), (3, 0.9)], "stage_2gpu": [{"step": 1, "loss": 2.1}, {"step": 2, "loss": 1.0}]}
    scaling = scaling_report(stages, 10_000, mrr)
    return json.loads(json.dumps(build_metrics_document(ranking, business, scaling, losses))), losses


def test_document_carries_every_figure(document):
    doc, _ = document
    ranking = doc["ranking"]
    for model in ("base", "stage_1gpu", "stage_2gpu"):
        figures = ranking["models"][model]
        assert set(METRIC_NAMES) <= set(figures["overall"])
        assert set(figures["by_task_type"]) == {"t2t", "t2i", "i2i"}
        assert set(figures["by_language"]) == {"en", "zh"}
        for group in (*figures["by_task_type"].values(), *figures["by_language"].values()):
            assert set(METRIC_NAMES) <= set(group)
    assert ranking["finetuned"] == "stage_2gpu"
    for model in ("stage_1gpu", "stage_2gpu"):
        mrr = ranking["comparisons"][model]["mrr_at_10"]
        assert {"base", "finetuned", "diff", "p_value", "ci_low", "ci_high"} <= set(mrr)
        assert mrr["ci_low"] <= mrr["diff"] <= mrr["ci_high"]
    business = doc["business"]["comparison"]
    for k in (5, 10):
        for name in ("expected_ctr", "expected_clicks", "expected_purchases", "long_tail_share", "coverage"):
            row = business[f"{name}_at_{k}"]
            assert set(row) == {"base", "finetuned", "uplift", "uplift_rel"}
            assert row["base"] is not None and row["finetuned"] is not None
    rows = doc["scaling"]["rows"]
    for field in ("devices", "wall_time_s", "pairs_per_s", "scaling_efficiency", "peak_mem_gib", "epoch_time_s",
                  "device_hours_per_epoch", "relative_device_hours", "mrr_at_10", "label"):
        assert all(field in r for r in rows)
    assert doc["scaling"]["summary"].startswith("Most cost-effective")
    assert doc["training"]["stage_1gpu"]["final_loss"] == 0.9


def test_markdown_report(document):
    doc, _ = document
    text = render_markdown(doc)
    for heading in ("# Evaluation report", "## Ranking quality", "### `stage_2gpu` vs `base`", "by task type",
                    "by query language", "## Business proxies", "## Scaling", "## Training losses", "## Plots"):
        assert heading in text
    assert "95% CI of difference" in text
    assert doc["scaling"]["summary"] in text
    for name in PLOT_FILES:
        assert f"(plots/{name})" in text


def _pixels_of(png: bytes, colour: str) -> int:
    """How many pixels of the PNG are exactly `colour` ("C0": the colour matplotlib gives the first series)."""
    from matplotlib.colors import to_rgb

    with Image.open(io.BytesIO(png)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return int((rgb == np.round(np.array(to_rgb(colour)) * 255).astype(np.uint8)).all(axis=-1).sum())


def _lines(ax) -> list[tuple[str, list[float], list[float]]]:
    return [(line.get_label(), [float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
            for line in ax.get_lines()]


def _bars(ax) -> dict[str, list[float]]:
    return {bars.get_label(): [float(bar.get_height()) for bar in bars] for bars in ax.containers}


def test_plots_decode_as_png_and_show_the_documents_figures(document, tmp_path):
    """Each plot draws the document's figures (the figure's artists), and the PNG shows them: each series in its
    colour; a bar chart's pixels per model proportional to the sum of that model's bars."""
    doc, losses = document
    models = doc["ranking"]["models"]
    plots = build_plots(doc, losses, {"stage_1gpu": [[1, 1e-4], [2, 5e-5], [3, 0.0]]})
    assert set(plots) == set(PLOT_FILES)
    pngs = {}
    for name, fig in plots.items():
        pngs[name] = figure_png(fig)
        (tmp_path / name).write_bytes(pngs[name])
        with Image.open(io.BytesIO(pngs[name])) as image:
            image.load()
            assert image.format == "PNG" and image.width > 200 and image.height > 200

    ax = plots["loss_curves.png"].axes[0]
    assert _lines(ax) == [("stage_1gpu", [1, 2, 3], [2.0, 1.2, 0.9]), ("stage_2gpu", [1, 2], [2.1, 1.0])]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("Training loss per stage", "step", "training loss")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["stage_1gpu", "stage_2gpu"]
    assert _pixels_of(pngs["loss_curves.png"], "C0") > 200 and _pixels_of(pngs["loss_curves.png"], "C1") > 200
    assert _pixels_of(pngs["loss_curves.png"], "C2") == 0  # two stages, two colours

    ax = plots["learning_rates.png"].axes[0]
    assert _lines(ax) == [("stage_1gpu", [1, 2, 3], [1e-4, 5e-5, 0.0])]
    assert _pixels_of(pngs["learning_rates.png"], "C0") > 200 and _pixels_of(pngs["learning_rates.png"], "C1") == 0

    ax = plots["metric_bars.png"].axes[0]
    overall = {m: [models[m]["overall"][k] for k in METRIC_NAMES] for m in models}
    assert _bars(ax) == overall  # the document's floats, as they are
    assert [t.get_text() for t in ax.get_xticklabels()] == ["MRR@10", "NDCG@10", "Recall@1", "Recall@5",
                                                            "Recall@10", "MAP"]
    assert [t.get_text() for t in ax.texts] == [f"{v:.2f}" for m in models for v in overall[m]]  # bar labels
    per_unit = [_pixels_of(pngs["metric_bars.png"], f"C{i}") / sum(overall[m]) for i, m in enumerate(models)]
    assert min(per_unit) > 1000 and max(per_unit) / min(per_unit) < 1.03, per_unit

    ax = plots["task_type_bars.png"].axes[0]
    by_task = {m: [models[m]["by_task_type"][t]["mrr_at_10"] for t in ("i2i", "t2i", "t2t")] for m in models}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["i2i", "t2i", "t2t"]
    assert _bars(ax) == by_task and ax.get_title() == "MRR@10 by task type"
    per_unit = [_pixels_of(pngs["task_type_bars.png"], f"C{i}") / sum(by_task[m]) for i, m in enumerate(models)]
    assert min(per_unit) > 1000 and max(per_unit) / min(per_unit) < 1.03, per_unit

    throughput, efficiency = plots["scaling.png"].axes
    assert _lines(throughput) == [("measured (GPUs)", [1, 2], [10.0, 18.0]), ("linear (GPUs)", [1, 2], [10.0, 20.0])]
    rows = doc["scaling"]["rows"]
    assert [bar.get_height() for bar in efficiency.patches] == pytest.approx(
        [100 * r["scaling_efficiency"] for r in rows]) == [100.0, 90.0]
    assert [t.get_text() for t in efficiency.get_xticklabels()] == ["1 GPU\nstage_1gpu", "2 GPUs\nstage_2gpu"]
    assert _pixels_of(pngs["scaling.png"], "C0") > 1000 and _pixels_of(pngs["scaling.png"], "C1") > 100


def test_plots_without_stages_say_so_and_still_show_the_ranking(document):
    """No stage and no model: every plot renders and says what is missing, with no series drawn. Models evaluated
    but no stage trained (the base model alone): the ranking plots show it, the training plots say none ran."""
    nothing = build_plots({"ranking": {"models": {}}, "scaling": None}, {})
    assert {name: [t.get_text() for ax in fig.axes for t in ax.texts] for name, fig in nothing.items()} == {
        "loss_curves.png": ["no training losses recorded"], "learning_rates.png": ["no learning rates recorded"],
        "metric_bars.png": ["no models were evaluated"], "task_type_bars.png": ["no task types in the test data"]}
    for name, fig in nothing.items():
        png = figure_png(fig)
        with Image.open(io.BytesIO(png)) as image:
            assert image.format == "PNG"
            grey = np.asarray(image.convert("L"))
        assert (grey < 128).sum() > 100, name  # the message is drawn: not a blank image
        assert not any(ax.get_lines() or ax.patches for ax in fig.axes), name
        assert all(_pixels_of(png, f"C{i}") == 0 for i in range(3)), name

    doc, _ = document
    base = doc["ranking"]["models"]["base"]
    plots = build_plots({"ranking": {**doc["ranking"], "models": {"base": base}}, "scaling": None}, {})
    assert set(plots) == set(PLOT_FILES) - {"scaling.png"}
    assert [t.get_text() for t in plots["loss_curves.png"].axes[0].texts] == ["no training losses recorded"]
    assert _bars(plots["metric_bars.png"].axes[0]) == {"base": [base["overall"][k] for k in METRIC_NAMES]}
    assert _pixels_of(figure_png(plots["metric_bars.png"]), "C0") > 1000


def test_mlflow_metrics_are_flat_and_named(document):
    doc, _ = document
    flat = mlflow_metrics(doc)
    assert all(isinstance(v, float) for v in flat.values())
    assert flat["test.mrr_at_10.finetuned"] == doc["ranking"]["models"]["stage_2gpu"]["overall"]["mrr_at_10"]
    assert flat["test.mrr_at_10.base"] == doc["ranking"]["models"]["base"]["overall"]["mrr_at_10"]
    assert flat["test.mrr_at_10.ci_low"] == doc["ranking"]["comparisons"]["stage_2gpu"]["mrr_at_10"]["ci_low"]
    assert "test.mrr_at_10.stage_1gpu.p_value" in flat
    assert "test.by_task_type.t2i.ndcg_at_10.finetuned" in flat
    assert flat["business.expected_ctr_at_10.uplift"] == doc["business"]["comparison"]["expected_ctr_at_10"]["uplift"]
    assert flat["scaling.stage_2gpu.scaling_efficiency"] == pytest.approx(0.9)
    assert flat["training.stage_1gpu.final_loss"] == 0.9


def test_loss_points_forms():
    assert loss_points([0.5, 0.4]) == [(1.0, 0.5), (2.0, 0.4)]
    assert loss_points([[10, 0.5]]) == [(10.0, 0.5)]
    assert loss_points([{"step": 3, "loss": 0.2}]) == [(3.0, 0.2)]
    assert loss_points(None) == []


def test_learning_rate_plot_draws_one_line_per_stage():
    from lychee_pipeline.evaluation.report import plot_learning_rates

    fig = plot_learning_rates({"stage_1cpu": [[1, 1e-4], [2, 5e-5], [3, 0.0]], "stage_2cpu_final": [[1, 1e-4]]})
    lines = fig.axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [3, 1]
    assert list(lines[0].get_ydata()) == [1e-4, 5e-5, 0.0]
    empty = plot_learning_rates({})
    assert not empty.axes[0].get_lines()


def test_recall_at_k_is_called_trivial_when_no_query_has_more_than_k_candidates(document):
    doc, _ = document
    assert doc["ranking"]["max_candidates_per_query"] == 6
    text = render_markdown(doc)
    header = next(line for line in text.splitlines() if line.startswith("| model | queries"))
    base_row = next(line for line in text.splitlines() if line.startswith("| base |"))
    cells = dict(zip(header.split("|"), base_row.split("|")))
    assert cells[" Recall@10 "].strip() == "trivial"          # 6 candidates: every relevant one is in the top 10
    assert cells[" Recall@5 "].strip() not in {"trivial", "–"}  # 6 > 5: a real result
    assert "Recall@10: every test query has at most 6 candidates" in text
    assert "| Recall@10 | trivial | trivial | trivial | – | trivial |" in text


def test_expected_purchases_units_are_explained(document):
    text = render_markdown(document[0])
    assert "`expected_purchases@k` is in the units of the documents' `purchased` field" in text


def test_one_stage_has_no_scaling_plot(document):
    doc, losses = document
    one = json.loads(json.dumps(doc))
    one["scaling"]["rows"] = one["scaling"]["rows"][:1]
    plots = build_plots(one, losses)
    assert "scaling.png" not in plots and set(plots) == set(PLOT_FILES) - {"scaling.png"}
    text = render_markdown(one)
    assert "(plots/scaling.png)" not in text and "No scaling plot: it needs stages on at least two" in text
    assert "(plots/scaling.png)" in render_markdown(doc)
