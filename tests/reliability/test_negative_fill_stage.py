"""A real `accelerate launch` stage (CPU, builtin:tiny) on records with fewer negatives than the group needs:
under `training.negative_fill: fill_random` it trains and reports the filled slots; under `refuse` the
training table is refused before any process starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from reliability_helpers import make_table, read_json, stage_plan

from lychee_pipeline.training import planning


def test_a_stage_trains_on_short_records_by_filling_their_groups(tmp_path, no_fault_env):
    table = make_table(tmp_path, negatives=2)  # 2 negatives each; group_size 4 needs 3
    plan = stage_plan(tmp_path, max_steps=3, per_device_batch_size=2)
    assert plan.training.negative_fill == "fill_random"  # the default
    data_path = planning.export_training_table(table, plan)
    result = planning.run_training_stage(data_path, plan, devices=1, final=True)
    assert result.steps == 3 and all(math.isfinite(loss) for _, loss in result.losses)
    # 3 steps x 2 groups, each short of 1 negative: every group collated had 1 slot filled with another
    # record's document (Accelerate's loader collates one batch ahead: 6 trained, up to 8 collated)
    fill = result.negative_fill
    assert fill["groups"] in (6, 8) and fill["filled_groups"] == fill["filled_slots"] == fill["groups"], fill
    assert read_json(Path(plan.run_dir) / "stage_1cpu_final" / "result.json")["negative_fill"] == fill

    refuse = stage_plan(tmp_path / "refuse", max_steps=3, negative_fill="refuse")
    with pytest.raises(ValueError, match="training.negative_fill=refuse: 9 of 9 training records have fewer than 3 "
                                         "negatives .*data_processing.normalization.min_negatives to at least 3"):
        planning.export_training_table(table, refuse)
