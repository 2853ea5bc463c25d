"""A complete StageResult for tests that need one without running a stage (figures chosen by each test)."""

from __future__ import annotations

from lychee_pipeline.reranker.processing import ProcessingConfig
from lychee_pipeline.training.stage import StageResult


def make_result(**fields) -> StageResult:
    values = dict(stage="stage_2cpu", devices=2, device_type="cpu", steps=3, train_pairs=24, full_train_pairs=80,
                  wall_time_s=3.0, pairs_per_s=1.0, peak_mem_gib=[1.0, 1.0], step_seconds=[[1, 1.0]],
                  losses=[[1, 1.0]], learning_rates=[], final_loss=1.0, replica_max_diff=0.0,
                  processing=ProcessingConfig(), adapter_dir="/tmp/x/adapter",
                  adapter_manifest="/tmp/x/adapter.manifest.json")
    return StageResult.model_validate({**values, **fields})
