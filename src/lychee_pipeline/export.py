"""The merged export's source and destination (Kedro-free): ``export.model`` and ``export.output_dir`` resolved.

``export.model`` is a registered version (``models:/<name>/<version>``, ``models:/<name>@<alias>``, named through
``registry.describe_model_uri``) or a saved folder (a training stage's adapter folder). A registered version's
logged model is downloaded into a temporary folder beside the output and its saved folder (the ``adapter``
artifact of the pyfunc model, ``tracking.log_reranker_model``) is exported, with the version's evaluation figures
(its run's metrics, else the figures tagged on the version) for the model card; a folder has none ("not evaluated").

The output folder: ``export.output_dir``, else ``data/06_models/exports/<name>``; a relative path is taken from the
project root and may not leave it (``..``); ``<name>`` is one plain folder name. The merge itself is
``reranker/export.py``.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from lychee_pipeline.reranker.export import ExportError, ExportSource

log = logging.getLogger(__name__)

EXPORT_ROOT = "data/06_models/exports"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ExportParams(BaseModel):
    """``export:`` (conf/base/parameters_export.yml)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "models:/lychee-reranker@champion"  # a models:/ URI or a saved adapter folder
    name: str | None = None  # the folder's name; None: <registered name>-v<version>, or the source folder's name
    output_dir: str | None = None  # None: data/06_models/exports/<name>
    overwrite: bool = False  # replace an existing output folder (once the new one is complete)
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: the base checkpoint's stored dtype
    device: str = "cpu"  # where the adapter is merged (cpu needs host memory for the whole model)


def is_registry_uri(model: str) -> bool:
    return model.startswith("models:/")


def _refuse_other_uris(model: str) -> None:
    if "://" in model or model.startswith(("runs:/", "m-")):
        raise ExportError(f"export.model {model!r}: pass a registered version (models:/<name>/<version> or "
                          "models:/<name>@<alias>) or a saved adapter folder")


def default_name(model: str, version: dict[str, Any] | None) -> str:
    if version is not None:
        return f"{version['model_name']}-v{version['model_version']}"
    return Path(model.rstrip("/")).name


def output_folder(params: ExportParams, name: str, root: Path) -> Path:
    """Where the export goes (see the module docstring), or :class:`ExportError`."""
    if not NAME.match(name):
        raise ExportError(f"export.name {name!r}: one folder name of letters, digits, '.', '_' or '-'")
    if params.output_dir is None:
        return root / EXPORT_ROOT / name
    out = Path(params.output_dir).expanduser()
    if out.is_absolute():
        return out
    resolved = (root / out).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ExportError(f"export.output_dir {params.output_dir!r} leaves the project ({root}); give an absolute "
                          "path to write elsewhere")
    return resolved


def version_figures(client: Any, version: Any) -> dict[str, float]:
    """The evaluation figures of a registered version: the metrics of the run it came from (the version's
    ``run_id``, or the ``run_id`` tag the registry node sets), else the figures tagged on the version itself
    (``test.<gate metric>``, or the ``metric.*`` tags older versions carry)."""
    run_id = version.run_id or (version.tags or {}).get("run_id")
    if run_id:
        try:
            metrics = client.get_run(run_id).data.metrics
        except Exception:  # noqa: BLE001 - a deleted run: the version's own tags are what is left
            metrics = {}
        if metrics:
            return {k: float(v) for k, v in metrics.items()}
    figures = {}
    for key, value in (version.tags or {}).items():
        name = key[len("metric."):] if key.startswith("metric.") else key if key.startswith("test.") else None
        if name is None:
            continue
        try:
            figures[name] = float(value)
        except ValueError:
            continue
    return figures


def saved_folder_of(downloaded: Path, uri: str) -> Path:
    """The saved reranker folder inside a downloaded pyfunc model (its ``adapter`` artifact)."""
    from mlflow.models import Model

    artifacts = Model.load(str(downloaded)).flavors.get("python_function", {}).get("artifacts") or {}
    adapter = artifacts.get("adapter")
    if not adapter:
        raise ExportError(f"{uri}: the logged model has no saved reranker folder (an `adapter` artifact); was it "
                          "logged by a lychee-pipeline run?")
    return downloaded / adapter["path"]


@contextmanager
def export_source(model: str, root: Path, work_dir: Path) -> Iterator[tuple[ExportSource, dict[str, Any] | None]]:
    """(the source to export, the registered version's description or None); a download lives in ``work_dir``
    until the block ends."""
    if not is_registry_uri(model):
        _refuse_other_uris(model)
        folder = Path(model).expanduser()
        folder = folder if folder.is_absolute() else root / folder
        yield ExportSource(folder=folder.resolve(), description=model), None
        return
    import mlflow

    from lychee_pipeline import registry

    version = registry.describe_model_uri(model)  # a one-line ValueError for an unknown name, version or alias
    client = mlflow.MlflowClient()
    registered = client.get_model_version(version["model_name"], str(version["model_version"]))
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=work_dir))
    try:
        downloaded = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{version['model_name']}/{version['model_version']}", dst_path=str(tmp)))
        provenance = {"registered model": version["model_name"], "version": version["model_version"],
                      "alias": version["model_alias"], "run": version["model_run_id"],
                      "gate": (registered.tags or {}).get("gate.reason")}
        yield ExportSource(folder=saved_folder_of(downloaded, model), description=model,
                           figures=version_figures(client, registered), provenance=provenance), version
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_model(params: ExportParams, root: Path, tiny_cache_dir: str | None = None) -> dict[str, Any]:
    """Export ``params.model`` (see the module docstring); returns a summary of what was written."""
    from lychee_pipeline.reranker.export import SCORING_FILE, export_merged, output_folder_free, saved_format

    root = Path(root).resolve()
    if is_registry_uri(params.model):
        # the name (and so the output folder) follows the version: check the folder before downloading anything
        name = params.name or default_name(params.model, _described(params.model))
    else:
        name = params.name or default_name(params.model, None)
    out = output_folder(params, name, root)
    output_folder_free(out, params.overwrite)
    with export_source(params.model, root, out.parent) as (source, version):
        kind = saved_format(source.folder)
        folder = export_merged(source, out, name=name, overwrite=params.overwrite, dtype=params.dtype,
                               device=params.device, tiny_cache_dir=tiny_cache_dir)
    import json

    scoring = json.loads((folder / SCORING_FILE).read_text(encoding="utf-8"))
    return {
        "model": params.model, **(version or {}), "source_format": kind, "output_dir": str(folder),
        "name": name, "family": scoring["family"], "architectures": scoring["architectures"],
        "yes_token_id": scoring["yes_token_id"], "no_token_id": scoring["no_token_id"],
        "evaluated": source.figures is not None, "figures": dict(source.figures or {}),
        "files": sorted(p.name for p in folder.iterdir()),
    }


def _described(model: str) -> dict[str, Any]:
    from lychee_pipeline import registry

    return registry.describe_model_uri(model)
