"""The MLflow calls kedro-mlflow does not cover: nested stage runs opened by rank 0, and the pyfunc model.

MLflow is optional in the training processes (the GPU benchmark machine has none): every call here is
guarded, and a tracking failure (store locked, server gone) is logged once and never stops training.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENV_PARENT_RUN = "LYCHEE_MLFLOW_PARENT_RUN_ID"
ENV_EXPERIMENT = "LYCHEE_MLFLOW_EXPERIMENT_ID"


class StageTracker:
    """A nested MLflow run for one training stage, written by rank 0 only."""

    def __init__(self, enabled: bool, run_name: str, tags: dict[str, str] | None = None):
        self.run_id: str | None = None
        self.failures: list[str] = []
        self._mlflow = None
        if not enabled or not os.environ.get("MLFLOW_TRACKING_URI"):
            return
        try:
            import mlflow
        except ImportError:
            log.warning("mlflow is not installed in the training environment: stage metrics go to result.json only")
            return
        self._mlflow = mlflow
        self._call(
            "start_run",
            lambda: self._start(run_name, tags or {}),
        )

    def _start(self, run_name: str, tags: dict[str, str]) -> None:
        client = self._mlflow.MlflowClient()
        parent = os.environ.get(ENV_PARENT_RUN)
        experiment_id = os.environ.get(ENV_EXPERIMENT)
        if experiment_id is None:
            experiment_id = self._mlflow.set_experiment("lychee_pipeline").experiment_id
        all_tags = dict(tags)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
        self.run_id = run.info.run_id
        self._client = client

    def _call(self, what: str, fn) -> Any:
        if self._mlflow is None:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a tracking failure must never stop training
            message = f"MLflow {what} failed: {type(exc).__name__}: {exc}"
            if not self.failures:
                log.warning("%s (training continues; figures are also in result.json)", message)
            self.failures.append(message)
            return None

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def log_params(self, params: dict[str, Any]) -> None:
        if self.active:
            flat = flatten(params)
            self._call("log_params", lambda: self._mlflow.log_params(flat, run_id=self.run_id))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.active:
            self._call("log_metrics", lambda: self._mlflow.log_metrics(metrics, step=step, run_id=self.run_id))

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        if self.active:
            self._call(
                "log_artifacts", lambda: self._client.log_artifacts(self.run_id, local_dir, artifact_path)
            )

    def end(self, status: str = "FINISHED") -> None:
        if self.active:
            self._call("end_run", lambda: self._client.set_terminated(self.run_id, status))


def flatten(params: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, str]:
    """Flatten nested parameters to `a.b.c` keys, values as short strings (MLflow's 6000-char limit)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = str(value)[:6000]
    return flat


#: Distributions the logged model imports (pinned to the installed versions). The project itself is not on
#: PyPI: serve with `--env-manager local` from its environment (docs/serving.md).
MODEL_REQUIREMENTS = ("mlflow", "torch", "transformers", "peft", "safetensors", "pillow", "pandas", "numpy")


def model_requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in MODEL_REQUIREMENTS:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def log_reranker_model(
    adapter_dir: str, base: str, artifact_name: str = "reranker", serving: dict[str, Any] | None = None
) -> str | None:
    """Log the fine-tuned reranker to the active MLflow run as a pyfunc model; returns its URI.

    ``serving`` adds serving settings to the model's ``reranker.json`` (scoring options, instructions,
    image roots: see ``mlflow_model.py``)."""
    import json
    import tempfile
    import warnings
    from pathlib import Path

    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    if mlflow.active_run() is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "reranker.json"
        config.write_text(json.dumps({**(serving or {}), "base": base}))
        # Any of the item columns may be empty; `task_type` (optional) is the record's, as in training.
        columns = [ColSpec("string", name) for name in ("query_text", "query_image", "doc_text", "doc_image")]
        with warnings.catch_warnings():
            # the signature is given: MLflow's advice to add an input example (it would load and run the model
            # to check it) is not needed
            warnings.filterwarnings("ignore", message=r".*An input example was not provided", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name=artifact_name,
                python_model=str(Path(__file__).with_name("mlflow_model.py")),
                artifacts={"adapter": adapter_dir, "config": str(config)},
                signature=ModelSignature(inputs=Schema([*columns, ColSpec("string", "task_type", required=False)]),
                                         outputs=Schema([ColSpec("double")])),
                # Listed, not inferred: inference loads the model in a subprocess (about 30 s on a small CPU).
                pip_requirements=model_requirements(),
            )
    return info.model_uri
