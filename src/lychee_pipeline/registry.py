"""The MLflow Model Registry side of a run (Kedro-free): register the final model, gate the champion alias.

A run's final model is registered as a new version of one registered model (``lychee-reranker`` by default)
with the run's metrics, data counts and processing settings as version tags. It gets the alias
``champion`` only if it beats the reference on this run's test split by the evaluation's paired test
(:func:`lychee_pipeline.evaluation.metrics.paired_comparison`):

- the reference is the current champion, scored in this run on the same candidates; with no champion
  yet, the base model (already scored by the evaluation);
- "beats" means: mean per-query difference of ``gate.metric`` above ``gate.min_improvement`` and the
  two-sided paired randomisation p-value below ``gate.alpha``.

Otherwise the version is registered with the reason as its description and the champion stays.
Rolling back is moving the alias: ``MlflowClient().set_registered_model_alias(name, "champion", version)``.

A version carries a handful of tags, the ones a person filters the registry page by (:data:`VERSION_TAGS`):
base model, family, fine-tuning mode, training data hash, stage, run, the gate's verdict and its headline
metric. Everything else the run had (its metrics, data counts, processing settings and the gate's figures,
:func:`run_details`) stays on the run and is listed in the registry report: with all of them as tags (about
340), one version row filled the registry page.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, field_validator

from lychee_pipeline.data.images import parse_image_roots
from lychee_pipeline.runtime.errors import InvalidParameter
from lychee_pipeline.evaluation.metrics import paired_comparison, per_query_metrics

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GateParams(_Strict):
    """``registry.gate``: what a new version must show against the reference to get the alias."""

    metric: str = "mrr_at_10"  # checked against the compared metrics, naming them (decide)
    alpha: float = 0.05
    min_improvement: float = 0.0


class RegistryParams(_Strict):
    """``registry:`` (conf/base/parameters_registry.yml)."""

    enabled: bool = True
    model_name: str = "lychee-reranker"
    alias: str = "champion"
    gate: GateParams = GateParams()


class ServingParams(_Strict):
    """``serving:``: what the logged MLflow model carries for serving (its reranker.json)."""

    image_roots: list[str] | None = None  # None: the run's data image roots

    @field_validator("image_roots", mode="before")
    @classmethod
    def _roots(cls, value: Any) -> list[str] | None:  # a YAML list, or one ':'-separated string from --params
        return None if value is None else parse_image_roots(value)


DEFAULT_GATE = GateParams().model_dump()
TAG_LIMIT = 5000  # MLflow's tag value limit


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def current_champion(client: Any, name: str, alias: str = "champion") -> Any | None:
    """The model version holding ``alias`` (None when the model or the alias does not exist)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def load_served_model(model_uri: str) -> Any:
    """The logged or registered pyfunc model, loaded as the server loads it (``mlflow_model.RerankerModel``):
    ``.reranker`` carries the logged scoring settings (its scores are the served ones), ``.image_roots`` the
    roots the server confines request image paths to (``LYCHEE_IMAGE_ROOTS``, else the logged ones)."""
    import mlflow

    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model()


def load_scorer(model_uri: str) -> Any:
    """The :class:`~lychee_pipeline.reranker.Reranker` inside a logged or registered pyfunc model."""
    return load_served_model(model_uri).reranker


def _unknown_model_version(client: Any, uri: str, name: str, wanted: str) -> str:
    """One line for a ``models:/`` URI that names no version: which versions exist, and why an alias may be unset."""
    import mlflow
    from mlflow.exceptions import MlflowException

    store = mlflow.get_tracking_uri()
    try:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        versions = []
    if not versions:
        return f"{uri}: no registered model {name!r} in {store} (a `full` run registers one)"
    why = (" (a version gets an alias only when it passes the promotion gate; data/08_reporting/registry_report.md "
           "says why it did not)") if wanted.startswith("alias") else ""
    return (f"{uri}: {name!r} has no {wanted} in {store}{why}; its versions: {', '.join(map(str, versions))}; "
            f"pass one, e.g. models:/{name}/{versions[-1]}")


def describe_model_uri(uri: str) -> dict[str, Any]:
    """``models:/name@alias`` or ``models:/name/version`` -> the registered name, version and run it came from."""
    import mlflow
    from mlflow.exceptions import MlflowException

    rest = uri[len("models:/"):]
    client = mlflow.MlflowClient()
    if "@" in rest:
        name, alias = rest.split("@", 1)
        number, wanted = None, f"alias {alias!r}"
    else:
        name, _, number = rest.partition("/")
        alias, wanted = None, f"version {number}"
    try:
        version = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    except MlflowException as exc:
        # the codes MLflow gives a missing model or version (RESOURCE_DOES_NOT_EXIST) and a missing alias
        # (INVALID_PARAMETER_VALUE); anything else (an unreachable server, no permission) is raised as it is
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE") or "'" in name:
            raise
        raise InvalidParameter(_unknown_model_version(client, uri, name, wanted)) from exc
    return {"model_name": name, "model_version": int(version.version), "model_alias": alias,
            "model_run_id": version.run_id}


def decide(comparison: Mapping[str, Mapping[str, Any]], gate: Mapping[str, Any], reference: str) -> tuple[bool, str]:
    """(promote?, reason) from a :func:`paired_comparison` of the reference (``base``) and the new model."""
    gate = {**DEFAULT_GATE, **dict(gate or {})}
    metric, alpha, min_improvement = str(gate["metric"]), float(gate["alpha"]), float(gate["min_improvement"])
    if metric not in comparison:
        raise InvalidParameter(f"invalid parameter registry.gate.metric: {metric!r} is not one of "
                               f"{sorted(comparison)}")
    row = comparison[metric]
    diff, p = row.get("diff"), row.get("p_value")
    figures = (f"{metric} {_fmt(row.get('base'))} -> {_fmt(row.get('finetuned'))} ({'+' if (diff or 0) >= 0 else ''}"
               f"{_fmt(diff)}), p={_fmt(p)} over {row.get('n_queries')} queries")
    if diff is None or p is None:
        return False, f"not promoted: too few test queries to compare with the {reference} ({figures})"
    failed = []
    if not diff > min_improvement:
        failed.append(f"difference {_fmt(diff)} is not above min_improvement {min_improvement:g}")
    if not p < alpha:
        failed.append(f"p-value {_fmt(p)} is not below alpha {alpha:g}")
    if failed:
        return False, f"not promoted: does not beat the {reference}: " + " and ".join(failed) + f" ({figures})"
    return True, f"promoted: beats the {reference} ({figures}, alpha {alpha:g})"


def compare(reference_scores: pd.DataFrame, new_scores: pd.DataFrame, *, seed: int = 0, n_resamples: int = 10_000,
            confidence_level: float = 0.95) -> dict[str, dict[str, Any]]:
    """The evaluation's paired comparison, reference as ``base`` and the new model as ``finetuned``.

    Only queries both tables hold are compared (the same test split, scored in this run).
    """
    return paired_comparison(per_query_metrics(reference_scores, seed), per_query_metrics(new_scores, seed),
                             n_resamples=n_resamples, confidence_level=confidence_level, seed=seed)


#: The tags of a registered version (besides ``gate.decision`` and ``test.<gate metric>``, added by the gate):
#: what a person filters versions by. ``data.train_sha256`` is the training table's sha256.
VERSION_TAGS = ("base_model", "family", "finetune", "data.train_sha256", "stage", "run_id")


def run_details(metrics: Mapping[str, Any], data_counts: Mapping[str, Any], processing: Mapping[str, Any],
                extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Flat strings for the registry report: ``metric.<name>``, ``data.<count>``, ``processing.<setting>`` and
    ``extra`` as given (the run holds the same figures as its metrics and parameters)."""
    tags: dict[str, str] = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            tags[f"metric.{key}"] = repr(float(value))
    for key, value in data_counts.items():
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            tags[f"data.{key}"] = str(value)
    for key, value in _flat(processing).items():
        tags[f"processing.{key}"] = value
    for key, value in (extra or {}).items():
        if value is not None:
            tags[str(key)] = str(value)
    return {k: v[:TAG_LIMIT] for k, v in tags.items()}


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flat(value, name))
        else:
            out[name] = str(value)
    return out


def register_and_gate(
    *,
    model_uri: str,
    name: str,
    new_scores: pd.DataFrame,
    base_scores: pd.DataFrame,
    score_reference: Callable[[str], pd.DataFrame],
    tags: Mapping[str, str],
    details: Mapping[str, str] | None = None,
    gate: Mapping[str, Any] | None = None,
    alias: str = "champion",
    seed: int = 0,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Register ``model_uri`` as a new version of ``name`` and give it ``alias`` if it passes the gate.

    ``score_reference(uri)`` scores the current champion (``models:/<name>/<version>``) on the same
    candidates as ``new_scores`` (the long scores table of the evaluation); with no champion the new
    model is compared with ``base_scores``. Uses the global MLflow tracking / registry URI.
    The version gets ``tags`` (those of :data:`VERSION_TAGS` only), the gate's verdict (``gate.decision``) and
    its headline metric (``test.<gate metric>``: the new model's value); ``details`` and the gate's figures go
    into the outcome's ``details`` for the report. Returns the outcome (what the run summary and the registry
    report show).
    """
    import mlflow

    client = mlflow.MlflowClient()
    gate = {**DEFAULT_GATE, **dict(gate or {})}
    champion = current_champion(client, name, alias)
    reference_scores, failure = base_scores, None
    if champion is not None:
        reference = f"current {alias} (version {champion.version})"
        try:
            reference_scores = score_reference(f"models:/{name}/{champion.version}")
        except Exception as exc:  # noqa: BLE001 - the new version is still registered, with the reason
            failure = f"not promoted: the {reference} could not be scored: {type(exc).__name__}: {exc}"
            log.error("registry: %s", failure)
    else:
        reference = "base model"
    if failure is None:
        comparison = compare(reference_scores, new_scores, seed=seed, n_resamples=n_resamples,
                             confidence_level=confidence_level)
        promote, reason = decide(comparison, gate, reference)
    else:
        comparison, promote, reason = {}, False, failure
    row = comparison.get(str(gate["metric"]), {})
    gate_tags = {
        "gate.decision": alias if promote else "not promoted",
        "gate.reason": reason,
        "gate.reference": reference,
        "gate.reference_version": champion.version if champion is not None else "base",
        "gate.metric": gate["metric"], "gate.alpha": gate["alpha"], "gate.min_improvement": gate["min_improvement"],
        "gate.reference_value": row.get("base"), "gate.value": row.get("finetuned"), "gate.diff": row.get("diff"),
        "gate.p_value": row.get("p_value"), "gate.n_queries": row.get("n_queries"),
        "gate.test": row.get("test"),
    }
    kept = {k: str(v)[:TAG_LIMIT] for k, v in tags.items() if k in VERSION_TAGS and v is not None}
    kept["gate.decision"] = gate_tags["gate.decision"]
    if row.get("finetuned") is not None:
        kept[f"test.{gate['metric']}"] = _fmt(row["finetuned"])
    version = mlflow.register_model(model_uri, name, tags=kept)
    # the gate's reason, whole, where the version page shows it (the verdict alone is a tag)
    client.update_model_version(name, version.version,
                                description=(f"{reason} (run {run_id})" if run_id else reason)[:TAG_LIMIT])
    if promote:
        client.set_registered_model_alias(name, alias, version.version)
        if champion is not None:
            client.set_model_version_tag(name, champion.version, "replaced_by", str(version.version))
    log.info("registry: %s version %s registered; %s", name, version.version, reason)
    return {
        "status": "registered",
        "name": name,
        "version": int(version.version),
        "model_uri": f"models:/{name}/{version.version}",
        "alias": alias,
        "promoted": promote,
        "champion_version": int(version.version) if promote else (int(champion.version) if champion else None),
        "previous_champion_version": int(champion.version) if champion is not None else None,
        "reference": reference,
        "reason": reason,
        "gate": gate,
        "comparison": comparison,
        "version_tags": kept,
        "details": {**dict(details or {}), **{k: str(v)[:TAG_LIMIT] for k, v in gate_tags.items() if v is not None}},
    }


def render_report(outcome: Mapping[str, Any]) -> str:
    """A short Markdown account of the registry step."""
    lines = ["# Model registry", ""]
    if outcome.get("status") != "registered":
        lines += [f"Not registered ({outcome.get('status')}): {outcome.get('reason')}", ""]
        return "\n".join(lines)
    name, version, alias = outcome["name"], outcome["version"], outcome["alias"]
    lines += [
        f"- registered: `{name}` version {version} (`{outcome['model_uri']}`)",
        f"- compared with: {outcome['reference']}, on this run's test split, paired randomisation test",
        f"- decision: {outcome['reason']}",
        f"- `{alias}` now: version {outcome['champion_version']}" if outcome.get("champion_version") is not None
        else f"- `{alias}`: none",
        "",
        "| metric | reference | new | diff | p-value | CI |",
        "|---|---|---|---|---|---|",
    ]
    for metric, row in (outcome.get("comparison") or {}).items():
        lines.append(f"| {metric} | {_fmt(row.get('base'))} | {_fmt(row.get('finetuned'))} | {_fmt(row.get('diff'))} "
                     f"| {_fmt(row.get('p_value'))} | [{_fmt(row.get('ci_low'))}, {_fmt(row.get('ci_high'))}] |")
    lines += ["", f"Roll back: `MlflowClient().set_registered_model_alias(\"{name}\", \"{alias}\", <version>)`.", ""]
    if outcome.get("version_tags"):
        lines += ["## The version's tags", "", "What the registry page shows and filters by:", "",
                  "| tag | value |", "|---|---|"]
        lines += [f"| `{k}` | {_cell(v)} |" for k, v in outcome["version_tags"].items()]
        lines.append("")
    if outcome.get("details"):
        lines += ["## What the run had", "",
                  "Its metrics, data counts, processing settings and the gate's figures (also on the run, not on "
                  "the version):", "", "| name | value |", "|---|---|"]
        lines += [f"| `{k}` | {_cell(v)} |" for k, v in sorted(outcome["details"].items())]
        lines.append("")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """A value as one Markdown table cell."""
    return " ".join(str(value).split()).replace("|", "\\|")


def summary_line(outcome: Mapping[str, Any] | None) -> str:
    """One phrase for the run summary."""
    if not outcome:
        return "not run"
    if outcome.get("status") != "registered":
        return f"{outcome.get('status')}: {outcome.get('reason')}"
    state = f"-> {outcome['alias']}" if outcome["promoted"] else f"{outcome['alias']} stays " + (
        f"v{outcome['champion_version']}" if outcome.get("champion_version") is not None else "unset")
    return f"{outcome['name']} v{outcome['version']} {state} ({outcome['reason']})"
