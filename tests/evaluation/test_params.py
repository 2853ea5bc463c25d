"""The `evaluation:` parameters, typed: the YAML validates as it is, a bad key is a one-line error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lychee_pipeline.evaluation.business import DEFAULT_KS
from lychee_pipeline.evaluation.params import EvaluationParams, evaluation_params

CONF = Path(__file__).resolve().parents[2] / "conf" / "base"


def test_the_parameter_file_validates_and_keeps_its_values():
    values = yaml.safe_load((CONF / "parameters_evaluation.yml").read_text())["evaluation"]
    params = evaluation_params(values)
    assert params.model_dump() == {**EvaluationParams().model_dump(), **values,
                                   **{k: {**getattr(EvaluationParams(), k).model_dump(), **values[k]}
                                      for k in ("scoring", "score_cache", "significance", "business", "scaling")}}
    assert params.business.ks == list(DEFAULT_KS) and evaluation_params(params) is params


def _disagreements(yaml_values: dict, defaults: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in yaml_values.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            out += _disagreements(value, defaults[key], f"{prefix}{key}.")  # keys of a free dict: no default
        elif key in defaults and value != defaults[key]:
            out.append(f"{prefix}{key}: yaml {value!r}, library {defaults[key]!r}")
    return out


def test_the_parameter_file_does_not_disagree_with_the_library_defaults():
    """Defaults are defined once: a key the YAML spells out has the value a missing key would get."""
    values = yaml.safe_load((CONF / "parameters_evaluation.yml").read_text())["evaluation"]
    assert _disagreements(values, EvaluationParams().model_dump()) == []


@pytest.mark.parametrize(("values", "message"), [
    ({"sed": 1}, "invalid parameter evaluation.sed: Extra inputs are not permitted (got 1)"),
    ({"business": {"ks": [5, 0]}}, "invalid parameter evaluation.business.ks.1: Input should be greater than 0 (got 0)"),
    ({"significance": {"confidence_level": 1.5}},
     "invalid parameter evaluation.significance.confidence_level: Input should be less than 1.0 (got 1.5)"),
])
def test_a_bad_key_is_a_one_line_error_naming_it(values, message):
    with pytest.raises(ValueError) as error:
        evaluation_params(values)
    assert str(error.value) == message
