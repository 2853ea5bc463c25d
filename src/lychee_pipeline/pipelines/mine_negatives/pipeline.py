"""mine_negatives: training records -> the same records with mined (and random) negatives added.

Reads only the train split (or its smoke subset): val and test are never mined from or into. Off by
default (``mining.enabled``, ``mining.smoke_enabled``): the table then passes through unchanged.
"""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import mine_smoke_negatives, mine_train_negatives

OUTPUTS = ["mined_train_records", "mining_counts", "mining_log", "mining_plot"]


def create_pipeline(**kwargs) -> Pipeline:
    """Mine the train split (the full pipeline)."""
    return Pipeline([Node(mine_train_negatives, ["train_records", "params:mining", "params:model"], OUTPUTS,
                          name="mine_negatives", tags=["mining"])])


def create_smoke_pipeline(**kwargs) -> Pipeline:
    """Mine the smoke subset (the smoke pipeline)."""
    return Pipeline([Node(mine_smoke_negatives, ["smoke_train_records", "params:mining", "params:model"], OUTPUTS,
                          name="mine_negatives", tags=["mining"])])
