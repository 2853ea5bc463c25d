"""Ingestion: parse + validate + normalize text + ids + dedup (02_intermediate)."""

from lychee_pipeline.pipelines.data_ingestion.pipeline import create_pipeline

__all__ = ["create_pipeline"]
