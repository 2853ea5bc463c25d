"""Evaluation pipeline: scoring, ranking metrics, business metrics, scaling report, report and plots."""

from lychee_pipeline.pipelines.evaluation.pipeline import create_pipeline

__all__ = ["create_pipeline"]
