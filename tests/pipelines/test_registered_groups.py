"""The registered pipelines' top level: one namespace per piece, so kedro-viz opens `smoke` and `full` as a short
chain of collapsed groups; the training stages nest inside `training`; the datasets read outside a group keep
their names, and every dataset the pipelines use is declared in the catalog with a kedro-viz layer."""

from __future__ import annotations

from pathlib import Path

import pytest
from kedro.config import OmegaConfigLoader
from kedro.io import DataCatalog

from lychee_pipeline.pipeline_registry import register_pipelines
from lychee_pipeline.pipelines.training.pipeline import SLOTS

REPO = Path(__file__).resolve().parents[2]
CHAIN = ["data_ingestion", "image_normalization", "data_split", "mining", "training", "evaluation", "reporting"]
PUBLIC = {"raw_source", "train_records", "test_records", "data_counts", "mined_train_records", "training_plan",
          "stage_results", "test_scores", "evaluation_report", "evaluation_mlflow_metrics", "run_summary"}


def _group(node) -> str:
    return (node.namespace or "").split(".")[0]


@pytest.fixture(scope="module")
def pipelines():
    return register_pipelines()


@pytest.mark.parametrize("name", ["smoke", "full"])
def test_the_top_level_is_a_chain_of_seven_groups(pipelines, name):
    pipe = pipelines[name]
    assert {_group(n) for n in pipe.nodes} == set(CHAIN)
    # a chain: no group reads what a later group writes (kedro-viz draws it top to bottom, no cycle between groups)
    writer = {out: _group(n) for n in pipe.nodes for out in n.outputs}
    for node in pipe.nodes:
        for dataset in set(node.inputs) & set(writer):
            assert CHAIN.index(writer[dataset]) <= CHAIN.index(_group(node)), (node.name, dataset, writer[dataset])
    # node names say where they sit: `<group>.<name>`, a stage's run and gate `training.train_stage_<n>.<name>`
    assert all(n.name == f"{n.namespace}.{n.name.rsplit('.', 1)[-1]}" for n in pipe.nodes)
    assert PUBLIC <= pipe.all_outputs(), sorted(PUBLIC - pipe.all_outputs())


def test_the_training_stages_nest_inside_training_and_keep_their_result_names(pipelines):
    full = pipelines["full"]
    stages = {n.namespace for n in full.nodes if n.namespace and n.namespace.count(".") == 1}
    assert stages == {f"training.{slot}" for slot in SLOTS}
    outputs = full.all_outputs()
    assert {f"{slot}_result" for slot in SLOTS} <= outputs  # what evaluation and the stage_results list read
    # inside `training` only: the exported table's path, each slot and each ungated result
    renamed = {d for d in outputs if "." in d}
    assert renamed and all(d.startswith("training.") for d in renamed), renamed
    # the parameters are the project's, not prefixed with the namespace (`params:training.model` does not exist)
    assert {"params:model", "params:training", "params:stages", "params:gpus"} <= full.inputs()
    assert not [d for d in full.inputs() if d.startswith("params:training.")]


def test_a_registered_piece_has_the_node_names_it_has_inside_full(pipelines):
    full = {n.name for n in pipelines["full"].nodes}
    for piece in ("data", "mine_negatives", "training", "evaluation"):
        names = {n.name for n in pipelines[piece].nodes}
        assert names <= full, (piece, sorted(names - full))
    assert "training.plan_training_stages" in full and "training.train_stage_final.gate_stage" in full


def test_every_dataset_is_in_the_catalog_with_a_layer(pipelines):
    config = OmegaConfigLoader(str(REPO / "conf"), base_env="base", default_run_env="local")["catalog"]
    catalog = DataCatalog.from_config(config)
    for name in ("smoke", "full", "training"):
        for dataset in sorted(pipelines[name].datasets()):
            if dataset.startswith("params:") or dataset == "parameters":
                continue
            assert dataset in catalog, f"{name}: {dataset} is not in the catalog (nor matched by a pattern)"
            layer = (catalog[dataset].metadata or {}).get("kedro-viz", {}).get("layer")
            assert layer, f"{name}: {dataset} has no kedro-viz layer"
