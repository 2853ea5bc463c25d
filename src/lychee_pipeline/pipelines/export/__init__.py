"""Merged export: a trained reranker (a registered version or an adapter folder) as a standalone model folder."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
