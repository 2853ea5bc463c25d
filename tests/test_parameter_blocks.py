"""The typed parameter blocks the data, mining, rerank, registry and serving nodes read: the YAML validates,
spells out the library's defaults (defined once, in the library), and a mistyped key is a one-line error
naming the closest known key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lychee_pipeline.data.params import DataParams, DataProcessingParams, RerankParams
from lychee_pipeline.export import ExportParams
from lychee_pipeline.mining import MiningParams
from lychee_pipeline.runtime.errors import typed
from lychee_pipeline.registry import DEFAULT_GATE, RegistryParams, ServingParams

CONF = Path(__file__).resolve().parents[1] / "conf" / "base"
BLOCKS = {  # block: (parameter file, typed model)
    "data": ("parameters_data.yml", DataParams),
    "data_processing": ("parameters_data.yml", DataProcessingParams),
    "mining": ("parameters_mining.yml", MiningParams),
    "rerank": ("parameters_rerank.yml", RerankParams),
    "registry": ("parameters_registry.yml", RegistryParams),
    "serving": ("parameters_registry.yml", ServingParams),
    "export": ("parameters_export.yml", ExportParams),
}
FREE = {"mining.reranker", "rerank.reranker"}  # keyword arguments of Reranker.from_pretrained: no defaults here


def _yaml(block: str) -> dict:
    return yaml.safe_load((CONF / BLOCKS[block][0]).read_text(encoding="utf-8"))[block]


def _disagreements(yaml_values: dict, defaults: dict, where: str) -> list[str]:
    out = []
    for key, value in yaml_values.items():
        name = f"{where}.{key}"
        if key not in defaults:
            out.append(f"{name} is not a parameter of the library")
        elif isinstance(value, dict) and name not in FREE:
            out += _disagreements(value, defaults[key], name)
        elif name not in FREE and value != (list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key]):
            out.append(f"{name}: YAML {value!r}, library default {defaults[key]!r}")
    return out


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_yaml_defaults_equal_the_library_defaults(block):
    _, model = BLOCKS[block]
    values = _yaml(block)
    assert _disagreements(values, model().model_dump(), block) == []
    typed(model, block, values)  # and it validates as it is


def test_every_yaml_key_the_library_has_is_spelled_out():
    """The other direction for the data blocks: a default the YAML does not show is a setting nobody sees."""
    shown = {"max_aspect_ratio"}  # the processor's limit: documented in docs/data.md, not a tuning knob
    dumped = DataProcessingParams().model_dump()
    yaml_values = _yaml("data_processing")
    missing = [f"{section}.{key}" for section, fields in dumped.items() for key in fields
               if key not in yaml_values[section] and key not in shown]
    assert missing == []
    assert DEFAULT_GATE == _yaml("registry")["gate"]


@pytest.mark.parametrize(("block", "values", "message"), [
    ("data_processing", {"split": {"sed": 7}},
     "invalid parameter data_processing.split.sed: Extra inputs are not permitted (got 7); "
     "did you mean data_processing.split.seed?"),
    ("data", {"raw_pth": "/x"},
     "invalid parameter data.raw_pth: Extra inputs are not permitted (got '/x'); did you mean data.raw_path?"),
    ("mining", {"rescore_tpo": 3},
     "invalid parameter mining.rescore_tpo: Extra inputs are not permitted (got 3); did you mean mining.rescore_top?"),
    ("registry", {"gate": {"alpa": 0.1}},
     "invalid parameter registry.gate.alpa: Extra inputs are not permitted (got 0.1); did you mean registry.gate.alpha?"),
    ("rerank", {"slice_pairs": 0}, "invalid parameter rerank.slice_pairs: Input should be greater than 0 (got 0)"),
    ("serving", {"roots": "/x"},
     "invalid parameter serving.roots: Extra inputs are not permitted (got '/x'); did you mean serving.image_roots?"),
    ("serving", {"port": 80}, "invalid parameter serving.port: Extra inputs are not permitted (got 80)"),  # no close key
    ("export", {"output_dr": "/x"},
     "invalid parameter export.output_dr: Extra inputs are not permitted (got '/x'); did you mean export.output_dir?"),
    ("export", {"dtype": "int8"}, "invalid parameter export.dtype: Input should be 'auto', 'fp32', 'bf16' or 'fp16' "
     "(got 'int8')"),
])
def test_a_bad_key_is_one_line_naming_it_and_the_closest_known_key(block, values, message):
    with pytest.raises(ValueError) as error:
        typed(BLOCKS[block][1], block, values)
    assert str(error.value) == message


def test_image_roots_take_a_list_or_one_pathsep_string():
    assert DataParams(image_roots="/a: /b").image_roots == ["/a", "/b"]
    assert RerankParams(image_roots=["/a", " "]).image_roots == ["/a"]
    assert ServingParams().image_roots is None and ServingParams(image_roots="/s").image_roots == ["/s"]
