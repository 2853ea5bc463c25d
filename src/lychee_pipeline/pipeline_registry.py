"""Project pipelines: the pieces, the composite `smoke` and `full` pipelines, and batch `rerank`."""

from __future__ import annotations

from kedro.pipeline import Pipeline

from lychee_pipeline.pipelines import (
    data_ingestion,
    data_split,
    demo_data,
    evaluation,
    image_normalization,
    mine_negatives,
    registry,
    rerank,
    reporting,
    training,
)


def register_pipelines() -> dict[str, Pipeline]:
    """Register the project's pipelines."""
    data = data_ingestion.create_pipeline() + image_normalization.create_pipeline() + data_split.create_pipeline()
    tail = evaluation.create_pipeline() + reporting.create_pipeline()
    # mine_negatives sits between the split and training (a pass-through while mining.enabled / smoke_enabled is off)
    smoke = (data + mine_negatives.create_smoke_pipeline()
             + Pipeline(training.create_smoke_pipeline(), inputs={"smoke_train_records": "mined_train_records"}) + tail)
    # full: the final model is registered and gated for the champion alias after evaluation and MLflow logging
    full = (data + mine_negatives.create_pipeline()
            + Pipeline(training.create_pipeline(), inputs={"train_records": "mined_train_records"})
            + evaluation.create_pipeline() + reporting.create_pipeline(registry=True) + registry.create_pipeline())
    return {
        "__default__": smoke,
        "smoke": smoke,
        "full": full,
        "demo_data": demo_data.create_pipeline(),
        "data": data,
        "mine_negatives": mine_negatives.create_pipeline(),
        "training": training.create_pipeline(),
        "evaluation": evaluation.create_pipeline(),
        "rerank": rerank.create_pipeline(),
    }
