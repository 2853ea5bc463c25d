"""Image-path normalization: resolve, confine to roots, verify once, manifest (03_primary)."""

from lychee_pipeline.pipelines.image_normalization.pipeline import create_pipeline

__all__ = ["create_pipeline"]
