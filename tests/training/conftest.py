"""A small learnable model-input table (contract schema) with real PNG images, for training tests."""

from __future__ import annotations

import pytest

from lychee_pipeline.training.synthetic import write_colour_item_table


@pytest.fixture(scope="session")
def training_table_path(tmp_path_factory) -> str:
    return str(write_colour_item_table(tmp_path_factory.mktemp("train_data")))
