"""The demo_data pipeline: the synthetic catalogue in data/01_raw/demo."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node

from lychee_pipeline.pipelines.demo_data.nodes import generate_demo_data


def create_pipeline(**kwargs) -> Pipeline:
    """Generate the demo data."""
    return Pipeline([node(generate_demo_data, "params:demo_data", "demo_data_summary", name="generate_demo_data")])
