"""Model registry step of `full`: register the final model, gate the champion alias, report it."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
