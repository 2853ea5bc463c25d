"""Project pipelines: the pieces, the composite `smoke` and `full` pipelines, batch `rerank`
and the merged `export`.

Each piece runs under a top-level namespace (`data_ingestion`, `image_normalization`, `data_split`, `mining`,
`training`, `evaluation`, `reporting`), so kedro-viz opens `smoke` and `full` as a short chain of collapsed
groups, the training stages nested inside `training` (`training.train_stage_1`, ...). Node names carry the
namespace (`--nodes training.plan_training_stages`); the datasets other pipelines, tests and the notebook read
keep their names (`stage_results`, `train_stage_1_result`, `test_scores`, ...): only what stays inside
`training` is prefixed (`training.training_data_path`, `training.train_stage_1.launched`). A registered piece
(`--pipelines training`) has the same node names as inside `full`.
"""

from __future__ import annotations

from kedro.pipeline import Pipeline

from lychee_pipeline.pipelines import (
    data_ingestion,
    data_split,
    demo_data,
    evaluation,
    export,
    image_normalization,
    mine_negatives,
    registry,
    rerank,
    reporting,
    training,
)
from lychee_pipeline.pipelines.training.pipeline import SLOTS


def group(pipe: Pipeline, namespace: str) -> Pipeline:
    """`pipe` as one collapsible kedro-viz group: its nodes named `<namespace>.<name>`, its datasets unrenamed."""
    return Pipeline(pipe, namespace=namespace, prefix_datasets_with_namespace=False)


def training_group(pipe: Pipeline, rename: dict[str, str] | None = None) -> Pipeline:
    """A training pipeline under `training`, its training table renamed by `rename`. Its stage namespaces have dotted
    datasets (`train_stage_1.launched`), which Kedro accepts only under the node's own top-level namespace, so
    here the datasets are prefixed too, except the ones read outside (the plan, each stage's result, the list) and
    the parameters."""
    public = ["training_plan", "stage_results", *(f"{slot}_result" for slot in SLOTS)]
    params = {name for name in pipe.inputs() if name.startswith("params:")}  # the project's, unprefixed
    tables = pipe.inputs() - params  # the table it trains on
    return Pipeline(pipe, namespace="training", inputs={name: (rename or {}).get(name, name) for name in tables},
                    outputs=sorted(set(public) & pipe.all_outputs()), parameters=params)


def register_pipelines() -> dict[str, Pipeline]:
    """Register the project's pipelines."""
    data = (group(data_ingestion.create_pipeline(), "data_ingestion")
            + group(image_normalization.create_pipeline(), "image_normalization")
            + group(data_split.create_pipeline(), "data_split"))
    staged_training = training_group(training.create_pipeline(), {"train_records": "mined_train_records"})
    scoring = group(evaluation.create_pipeline(), "evaluation")
    # mining sits between the split and training (a pass-through while mining.enabled / smoke_enabled is off)
    smoke = (data + group(mine_negatives.create_smoke_pipeline(), "mining")
             + training_group(training.create_smoke_pipeline(), {"smoke_train_records": "mined_train_records"})
             + scoring + group(reporting.create_pipeline(), "reporting"))
    # full: the final model is registered and gated for the champion alias after evaluation and MLflow logging;
    # registration reads the MLflow logging and the run summary reads its outcome, so both share one group
    full = (data + group(mine_negatives.create_pipeline(), "mining") + staged_training + scoring
            + group(reporting.create_pipeline(registry=True) + registry.create_pipeline(), "reporting"))
    return {
        "__default__": smoke,
        "smoke": smoke,
        "full": full,
        "demo_data": demo_data.create_pipeline(),
        "data": data,
        "mine_negatives": group(mine_negatives.create_pipeline(), "mining"),
        "training": training_group(training.create_pipeline()),
        "evaluation": scoring,
        "rerank": rerank.create_pipeline(),
        "export": export.create_pipeline(),
    }
