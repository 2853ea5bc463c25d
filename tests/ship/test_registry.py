"""Registry and champion gate, for real: tiny models with different weights, the evaluation's scoring, a sqlite
MLflow store, the registry node of `full`. Labels make the outcome known: a split's positives are the documents
one model ranks first, so that model wins it and the others do not."""

from __future__ import annotations

import shutil
from urllib.parse import urlparse

import mlflow
import pytest

from lychee_pipeline.registry import decide, run_details
from ship_support import candidate_queries, make_test_records, mlflow_store, register_run, score_pairs


NAME = "gate-test-reranker"


def _row(diff, p, n=24):
    return {"mrr_at_10": {"base": 0.5, "finetuned": 0.5 + (diff or 0), "diff": diff, "p_value": p, "n_queries": n}}


def test_gate_rule_needs_both_the_difference_and_the_p_value():
    gate = {"metric": "mrr_at_10", "alpha": 0.05, "min_improvement": 0.01}
    assert decide(_row(0.2, 0.001), gate, "base model")[0]
    promote, reason = decide(_row(0.2, 0.2), gate, "base model")
    assert not promote and "p-value 0.2000 is not below alpha 0.05" in reason
    promote, reason = decide(_row(0.005, 0.001), gate, "current champion (version 1)")
    assert not promote and "difference 0.0050 is not above min_improvement 0.01" in reason
    assert "current champion (version 1)" in reason
    promote, reason = decide(_row(-0.3, 0.001), gate, "base model")
    assert not promote
    assert not decide(_row(None, None, 1), gate, "base model")[0]
    with pytest.raises(ValueError, match="registry.gate.metric"):
        decide(_row(0.2, 0.001), {"metric": "mrr"}, "base model")


def test_run_details_hold_metrics_counts_and_processing():
    tags = run_details({"test.mrr_at_10.finetuned": 0.5}, {"lines_in": 10, "ok": True},
                        {"training": {"max_pixels": 12544}, "split": {"seed": 42}}, {"run_id": "r", "none": None})
    assert tags == {"metric.test.mrr_at_10.finetuned": "0.5", "data.lines_in": "10",
                    "processing.training.max_pixels": "12544", "processing.split.seed": "42", "run_id": "r"}


def test_champion_gate_first_version_then_refused_then_replaced(champion_project, ship_models, ship_images):
    """v1 (model a) beats the base model -> champion; v2 (model b) does not beat champion v1 on a split a wins ->
    registered with the reason, champion stays; v3 (model b) beats champion v1 on a split b wins -> champion;
    v4 while champion v3 cannot be loaded -> registered with that reason, champion stays.
    (A model name of its own, in the store of the champion project: one sqlite store to create, not two.)"""
    queries = candidate_queries(ship_images)
    a_wins = champion_project["records"]  # the split model a wins (its first choices are the positives)
    b_wins = make_test_records(queries, score_pairs(ship_models["b"], queries))
    assert a_wins != b_wins  # the two models disagree on some queries' best document
    with mlflow_store(champion_project["root"]):
        client = mlflow.MlflowClient()
        first, _ = register_run(a_wins, ship_models["a"], ship_models["base"], ship_images, name=NAME)
        assert first["version"] == 1 and first["promoted"], first["reason"]
        assert first["reference"] == "base model"
        assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"

        second, _ = register_run(a_wins, ship_models["b"], ship_models["base"], ship_images, name=NAME)
        assert second["version"] == 2 and not second["promoted"]
        assert second["reference"] == "current champion (version 1)"
        assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
        v2 = client.get_model_version(NAME, "2")
        assert v2.tags["gate.decision"] == "not promoted"
        assert v2.description.startswith("not promoted: does not beat the current champion (version 1)")
        # the champion was scored in this run on the same split: it wins its own split outright
        assert float(second["details"]["gate.reference_value"]) == pytest.approx(1.0)
        assert float(second["details"]["gate.diff"]) < 0

        third, _ = register_run(b_wins, ship_models["b"], ship_models["base"], ship_images, name=NAME)
        assert third["version"] == 3 and third["promoted"], third["reason"]
        assert third["previous_champion_version"] == 1
        assert str(client.get_model_version_by_alias(NAME, "champion").version) == "3"
        assert client.get_model_version(NAME, "1").tags["replaced_by"] == "3"
        v3 = client.get_model_version(NAME, "3")
        assert float(v3.tags["test.mrr_at_10"]) == pytest.approx(1.0) and float(third["details"]["gate.p_value"]) < 0.05
        # the registry page: a handful of tags to filter by (about 340 before: one version row filled the page)
        assert set(v3.tags) == {"base_model", "family", "finetune", "stage", "run_id", "gate.decision",
                                "test.mrr_at_10"}, sorted(v3.tags)
        assert (v3.tags["family"], v3.tags["finetune"], v3.tags["gate.decision"]) == ("qwen2_5_vl", "full", "champion")
        # what the run had: metrics, data counts, processing settings, in the outcome and the registry report
        details = third["details"]
        assert details["metric.test.mrr_at_10.finetuned"] == "0.9"
        assert details["data.test_size"] == "24"
        assert details["processing.training.max_pixels"] == "12544"
        assert details["processing.split.seed"] == "42"
        assert details["processing.scoring.batch_size"] == "16"
        assert v3.run_id and v3.tags["run_id"] == v3.run_id
        run = client.get_run(v3.run_id)
        assert run.data.tags["registry.version"] == "3" and run.data.tags["registry.promoted"] == "True"

        # the champion's files are gone: the next version is still registered, says why, and the alias stays
        shutil.rmtree(urlparse(client.get_model_version_download_uri(NAME, "3")).path)
        fourth, _ = register_run(b_wins, ship_models["a"], ship_models["base"], ship_images, name=NAME)
        assert fourth["version"] == 4 and not fourth["promoted"]
        assert fourth["reason"].startswith("not promoted: the current champion (version 3) could not be scored")
        assert client.get_model_version(NAME, "4").description.startswith(fourth["reason"])
        assert str(client.get_model_version_by_alias(NAME, "champion").version) == "3"


def test_a_models_uri_without_its_version_is_one_line_naming_the_versions(tmp_path):
    """After a `full` run whose versions all failed the gate, `models:/<name>@champion` (the README's serve and
    rerank commands) names the versions there are and the report that says why, instead of MLflow's
    'alias not found' in a traceback; a missing model or version is named the same way."""
    from lychee_pipeline.registry import describe_model_uri

    with mlflow_store(tmp_path):
        with pytest.raises(ValueError, match="no registered model 'never-registered'"):
            describe_model_uri("models:/never-registered@champion")
        client = mlflow.MlflowClient()
        client.create_registered_model(NAME)
        for _ in range(2):
            client.create_model_version(NAME, source=str(tmp_path))
        missing_alias = (rf"models:/{NAME}@champion: '{NAME}' has no alias 'champion' .*registry_report.md.*"
                         rf"its versions: 1, 2; pass one, e.g. models:/{NAME}/2")
        with pytest.raises(ValueError, match=missing_alias):
            describe_model_uri(f"models:/{NAME}@champion")
        with pytest.raises(ValueError, match=r"has no version 7 .*its versions: 1, 2"):
            describe_model_uri(f"models:/{NAME}/7")
        assert describe_model_uri(f"models:/{NAME}/2")["model_version"] == 2


def test_the_data_hash_tag_is_the_training_table_the_stage_read(tmp_path):
    """`data.train_sha256`: the bytes of the table named in the final stage's spec.json (None when it is gone)."""
    from stage_results import make_result

    from lychee_pipeline.pipelines.registry.nodes import _training_data_sha256
    from lychee_pipeline.reranker.model import ModelConfig
    from lychee_pipeline.runtime.files import sha256_file
    from lychee_pipeline.training.config import TrainingParams
    from lychee_pipeline.training.stage import SPEC_FILE, StageSpec

    table = tmp_path / "train.parquet"
    table.write_bytes(b"the training table")
    stage = tmp_path / "stage_1cpu_final"
    stage.mkdir()
    StageSpec(stage=stage.name, data_path=str(table), output_dir=str(stage),
              model=ModelConfig(name_or_path="builtin:tiny"), training=TrainingParams()).write(stage / SPEC_FILE)
    result = make_result(stage=stage.name, adapter_dir=str(stage / "adapter"))
    assert _training_data_sha256(result) == sha256_file(table)
    table.unlink()
    assert _training_data_sha256(result) is None
