"""Launch one training stage: its typed `StageSpec` as a runtime `LaunchJob` running `training/train.py` in
each process, and its `StageResult` (or machine share) back; on a failure or an interrupt, the stage's MLflow
runs left open by rank 0 are ended as FAILED or KILLED."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from lychee_pipeline.runtime.launcher import LaunchJob, launch
from lychee_pipeline.training.stage import SPEC_FILE, StageOutcome, StageSpec, stage_outcome

log = logging.getLogger(__name__)

ENTRY_MODULE = "lychee_pipeline.training.train"


def run_stage(
    stage_dir: Path,
    spec: StageSpec,
    devices: int,
    device_type: str,
    template: dict[str, Any] | None = None,
    tracking_env: dict[str, str] | None = None,
) -> StageOutcome:
    """Run one stage to completion and return its outcome, or raise StageFailed."""
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    tracking_env = tracking_env or {}
    job = LaunchJob(name=spec.stage, module=ENTRY_MODULE, spec_file=stage_dir / SPEC_FILE,
                    spec_text=json.dumps(spec.model_dump(), indent=1, default=str), folder=stage_dir,
                    devices=devices, device_type=device_type, launch=spec.training.launch, template=template,
                    env=tracking_env, what=f"training stage {spec.stage!r}",
                    on_stop=functools.partial(end_stage_runs, tracking_env),
                    left_for="for a resume (training.resume: true)")
    return stage_outcome(launch(job))


def end_stage_runs(tracking_env: dict[str, str], status: str, reason: str) -> list[str]:
    """End the stage runs under the parent MLflow run that are still RUNNING (rank 0 could not), with a reason.

    Returns the run ids it ended. Never raises: the stage's own error is the one that matters.
    """
    parent, uri = tracking_env.get("LYCHEE_MLFLOW_PARENT_RUN_ID"), tracking_env.get("MLFLOW_TRACKING_URI")
    if not parent or not uri:
        return []
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs(
            [tracking_env["LYCHEE_MLFLOW_EXPERIMENT_ID"]] if tracking_env.get("LYCHEE_MLFLOW_EXPERIMENT_ID") else [],
            filter_string=f"tags.mlflow.parentRunId = '{parent}' and attributes.status = 'RUNNING'",
        )
        ended = []
        for run in runs:
            client.set_tag(run.info.run_id, "failure_reason", reason[:5000])
            client.set_terminated(run.info.run_id, status)
            ended.append(run.info.run_id)
            log.info("MLflow stage run %s ended as %s (%s)", run.info.run_id, status, reason.splitlines()[0])
        return ended
    except Exception as exc:  # noqa: BLE001
        log.warning("could not end the open MLflow stage runs: %s: %s", type(exc).__name__, exc)
        return []
