"""The stage contract (StageSpec, StageResult) and the one model config: round trips, unknown keys, and the
parameter files agreeing with the library's defaults."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from lychee_pipeline.evaluation.business import DEFAULT_KS
from lychee_pipeline.reranker.collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from lychee_pipeline.reranker.model import LoraConfig, ModelConfig
from lychee_pipeline.training.config import StageParams, TrainingParams
from lychee_pipeline.training.stage import (
    MachineShare,
    StageResult,
    StageSpec,
    as_stage_results,
    spec_hash,
    stage_outcome,
)

from stage_results import make_result

CONF = Path(__file__).resolve().parents[2] / "conf" / "base"


def _spec(tmp_path, **fields) -> StageSpec:
    data = tmp_path / "train.parquet"
    data.write_bytes(b"rows")
    values = dict(stage="stage_1cpu_final", data_path=str(data), output_dir=str(tmp_path / "stage"),
                  model=ModelConfig(lora=LoraConfig(r=4)), training=TrainingParams(max_steps=3))
    return StageSpec(**{**values, **fields}).with_hash()


def test_spec_round_trips_through_its_json_file(tmp_path):
    spec = _spec(tmp_path)
    spec.write(tmp_path / "spec.json")
    on_disk = json.loads((tmp_path / "spec.json").read_text())
    assert on_disk["model"]["lora"]["r"] == 4 and on_disk["training"]["max_steps"] == 3  # readable JSON
    again = StageSpec.read(tmp_path / "spec.json")
    assert again == spec and isinstance(again.model, ModelConfig) and again.model.lora.r == 4


def test_result_round_trips_with_a_non_finite_loss(tmp_path):
    result = make_result(losses=[[1, 0.5]], final_loss=math.nan, skipped_steps=[[2, math.nan, math.inf]])
    result.write(tmp_path / "result.json")
    assert "NaN" in (tmp_path / "result.json").read_text()
    again = StageResult.read(tmp_path / "result.json")
    (step, loss, grad_norm), = again.skipped_steps
    assert math.isnan(again.final_loss) and step == 2 and math.isnan(loss) and grad_norm == math.inf
    assert again.model_dump(exclude={"final_loss", "skipped_steps"}) == result.model_dump(
        exclude={"final_loss", "skipped_steps"})
    assert isinstance(stage_outcome(again.model_dump()), StageResult)


def test_an_undeclared_result_field_is_refused():
    with pytest.raises(ValidationError, match="relaunched"):
        StageResult.model_validate({**make_result().model_dump(), "relaunched": True})


def test_a_machine_share_is_its_own_outcome(caplog):
    """What a multi-node stage returns on machine rank > 0 (the dict launch.run_stage builds there): machine rank 0
    holds the StageResult, so the share carries no figures. The gate passes it on without the checks that need
    figures (and says so); evaluation and the report refuse it, naming the machine rank."""
    from lychee_pipeline.training.config import GateParams
    from lychee_pipeline.training.gate import StageGateError, check_stage

    launched = {"stage": "stage_4gpu_final", "machine_rank": 1, "num_machines": 2, "result_on_machine_rank_0": True,
                "progress": "rank 2: step 4 (step)"}
    share = stage_outcome(launched)
    assert isinstance(share, MachineShare) and not isinstance(share, StageResult)
    assert (share.stage, share.machine_rank, share.num_machines, share.progress) == (
        "stage_4gpu_final", 1, 2, "rank 2: step 4 (step)")
    assert (share.final, share.reused) == (False, False)
    assert stage_outcome(share.model_dump()) == share  # the slot's JSON dataset gives the same share back

    # The gate: a result without a loss fails 'finite loss'; the share has none and is passed on as it is.
    with pytest.raises(StageGateError, match="gate 'finite loss' failed for stage_4gpu_final"):
        check_stage(make_result(stage="stage_4gpu_final", losses=[]), GateParams())
    with caplog.at_level(logging.INFO, logger="lychee_pipeline.training.gate"):
        assert check_stage(share, GateParams()) is share
    assert ("stage stage_4gpu_final: machine rank 1 trained its part; the gate runs on machine rank 0"
            in caplog.messages)

    # Evaluation and the report take StageResults only.
    with pytest.raises(ValueError, match=r"^stage result 'stage_4gpu_final' is machine rank 1's share; "
                                         r"machine rank 0 holds the StageResult$"):
        as_stage_results([make_result(stage="stage_2cpu"), launched])

    # The flag decides what the dict is: without it, the same fields are an incomplete StageResult (refused);
    # a share that says its result is elsewhere only with True, and declares every field.
    with pytest.raises(ValidationError, match="adapter_dir"):
        stage_outcome({k: v for k, v in launched.items() if k != "result_on_machine_rank_0"})
    with pytest.raises(ValidationError, match="result_on_machine_rank_0"):
        MachineShare.model_validate({**launched, "result_on_machine_rank_0": False})
    with pytest.raises(ValidationError, match="losses"):
        stage_outcome({**launched, "losses": [[1, 0.5]]})


def test_stage_results_are_typed_at_the_boundary_with_a_one_line_error():
    typed = make_result(stage="stage_1cpu")
    results = as_stage_results([typed, make_result(stage="stage_2cpu_final", final=True).model_dump()])
    assert results[0] is typed and isinstance(results[1], StageResult) and results[1].final
    assert as_stage_results(None) == []
    partial = {k: v for k, v in make_result(stage="stage_2cpu").model_dump().items() if k not in ("steps", "processing")}
    with pytest.raises(ValueError) as error:
        as_stage_results([typed, {**partial, "relaunched": True}])
    assert str(error.value) == ("stage result 'stage_2cpu' is not a valid StageResult: steps: Field required; "
                                "processing: Field required; relaunched: Extra inputs are not permitted")
    share = MachineShare(stage="stage_4gpu_final", machine_rank=1, num_machines=2).model_dump()
    with pytest.raises(ValueError, match="^stage result 'stage_4gpu_final' is machine rank 1's share; machine rank 0"):
        as_stage_results([share])


def test_spec_hash_leaves_out_locations_and_timeouts_but_hashes_the_data_bytes(tmp_path):
    spec = _spec(tmp_path)
    moved = spec.model_copy(update={"output_dir": "/elsewhere", "spec_hash": None})
    assert spec_hash(moved) == spec.spec_hash
    patient = spec.model_copy(update={"training": spec.training.model_copy(
        update={"resume": True, "launch": spec.training.launch.model_copy(update={"timeout_s": 5})})})
    assert spec_hash(patient) == spec.spec_hash
    assert spec_hash(spec.model_copy(update={"model": ModelConfig(lora=LoraConfig(r=8))})) != spec.spec_hash
    Path(spec.data_path).write_bytes(b"other rows")
    assert spec_hash(spec) != spec.spec_hash


def test_unknown_model_key_is_refused_by_the_one_model_config(tmp_path):
    with pytest.raises(TypeError):
        ModelConfig(lora_rank=8)
    with pytest.raises(ValidationError, match="lora_rank"):
        StageSpec.model_validate({**_spec(tmp_path).model_dump(), "model": {"lora_rank": 8}})


def _yaml(name: str) -> dict:
    return yaml.safe_load((CONF / name).read_text())


def _same(yaml_values: dict, defaults: dict, where: str) -> None:
    for key, value in yaml_values.items():
        assert key in defaults, f"{where}.{key} is not a parameter"
        if isinstance(value, dict) and isinstance(defaults[key], dict):
            _same(value, defaults[key], f"{where}.{key}")
        else:
            assert value == defaults[key], f"{where}.{key}: YAML {value!r}, library default {defaults[key]!r}"


def test_yaml_defaults_equal_the_library_defaults():
    params = _yaml("parameters_training.yml")
    _same(params["model"], dataclasses.asdict(ModelConfig()), "model")
    _same(params["training"], TrainingParams().model_dump(), "training")
    _same(params["stages"], StageParams().model_dump(), "stages")
    training = TrainingParams()
    assert (training.max_length, training.min_pixels, training.max_pixels) == (
        DEFAULT_MAX_LENGTH, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    assert list(_yaml("parameters_evaluation.yml")["evaluation"]["business"]["ks"]) == list(DEFAULT_KS)
