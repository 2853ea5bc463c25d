"""The staged training pipeline's wiring: one stage template under a namespace per ladder rung, run with
Kedro's SequentialRunner on real CPU stages (builtin:tiny, LoRA r=4, a few steps)."""

from __future__ import annotations

import inspect

import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from lychee_pipeline.pipelines.training import create_pipeline, create_smoke_pipeline
from lychee_pipeline.pipelines.training import nodes as training_nodes
from lychee_pipeline.training.planning import CHECK_RUNGS, rung_devices
from lychee_pipeline.training.synthetic import write_colour_item_table

NAMESPACES = [f"train_stage_{n}" for n in rung_devices()] + ["train_stage_final"]


def test_every_rung_is_the_same_template_under_its_namespace():
    pipe = create_pipeline()
    assert len(NAMESPACES) == CHECK_RUNGS + 1
    for namespace in NAMESPACES:
        inner = sorted(n.name for n in pipe.nodes if n.namespace == namespace)
        assert inner == [f"{namespace}.gate_stage", f"{namespace}.run_stage"], namespace
        tag = namespace.removeprefix("train_")
        assert all({"training", tag} <= n.tags for n in pipe.nodes if n.namespace == namespace)
    # wiring only: every node runs a function defined at the top of nodes.py (no closures, no renaming)
    for node in pipe.nodes:
        assert node.func.__qualname__ == node.func.__name__ and inspect.getmodule(node.func) is training_nodes
    # the rungs run in ladder order: each waits for the result of the one before
    order = [n.name for n in pipe.nodes if n.name.endswith(".run_stage")]
    assert order == [f"{ns}.run_stage" for ns in NAMESPACES]


def _params(tmp_path, gpus: int) -> dict:
    return {
        "params:model": {"name_or_path": "builtin:tiny", "lora": {"r": 4}},
        "params:training": {"group_size": 4, "learning_rate": 1e-3, "warmup_ratio": 0.0, "scheduler": "constant",
                            "max_steps": 3, "max_length": 256, "max_pixels": 12544, "checkpoint_every": 100,
                            "launch": {"timeout_s": 300, "process_group_timeout_s": 30}},
        "params:stages": {"check_steps": {1: 3, 2: 3}, "gate": {"loss_fall_tolerance": 10.0}},
        "params:gpus": gpus,
        "params:device": "cpu",
        "params:run": {"name": "wiring", "output_root": str(tmp_path / "runs")},
    }


@pytest.fixture(scope="module")
def train_records(tmp_path_factory):
    import pyarrow.parquet as pq

    return pq.read_table(write_colour_item_table(tmp_path_factory.mktemp("records")))


def test_gpus_2_runs_the_check_stage_then_the_final_stage(tmp_path, train_records):
    from kedro_datasets.json import JSONDataset

    unused = JSONDataset(filepath=str(tmp_path / "stage_4.json"))  # a file: the runner does not free it
    catalog = DataCatalog({"train_records": MemoryDataset(train_records), "train_stage_4_result": unused,
                           **{k: MemoryDataset(v) for k, v in _params(tmp_path, 2).items()}})
    SequentialRunner().run(create_pipeline(), catalog)
    results = catalog.load("stage_results")
    assert [(r["stage"], r["devices"], r["final"]) for r in results] == [("stage_1cpu", 1, False),
                                                                          ("stage_2cpu_final", 2, True)]
    assert unused.load()["unused_slot"] is True  # a rung gpus=2 does not need: it said why, and launched nothing
    assert not (tmp_path / "runs" / "wiring" / "stage_4cpu").exists()
    assert all(r["steps"] == 3 and r["spec_hash"] for r in results)


def test_smoke_pipeline_runs_the_final_stage_alone(tmp_path, train_records):
    params = {k: v for k, v in _params(tmp_path, 1).items() if k != "params:gpus"}
    catalog = DataCatalog({"smoke_train_records": MemoryDataset(train_records),
                           "params:smoke": MemoryDataset({"run_name": "smoke_wiring", "training": {"max_steps": 2}}),
                           **{k: MemoryDataset(v) for k, v in params.items()}})
    SequentialRunner().run(create_smoke_pipeline(), catalog)
    (result,) = catalog.load("stage_results")
    assert (result["stage"], result["final"], result["steps"]) == ("stage_1cpu_final", True, 2)
