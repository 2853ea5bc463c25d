"""Hard-negative mining of the training split (between data_split and training)."""

from lychee_pipeline.pipelines.mine_negatives.pipeline import create_pipeline, create_smoke_pipeline

__all__ = ["create_pipeline", "create_smoke_pipeline"]
