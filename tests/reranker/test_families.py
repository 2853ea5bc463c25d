"""The family contract: every registered family provides the names of ModelFamily, and a fast path a family
refuses fails in one line naming the setting (or, for kernels=auto, keeps the plain path) instead of running."""

from __future__ import annotations

import sys
import types

import pytest

from lychee_pipeline.reranker import families
from lychee_pipeline.reranker.families import FAST_PATHS, ModelFamily, contract_names, qwen2_5_vl
from lychee_pipeline.reranker.kernels import resolve_kernels


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_every_registered_family_provides_the_contract(model_type):
    family = families.family_for(model_type)
    assert isinstance(family, ModelFamily)
    assert family.NAME == model_type
    assert set(family.REFUSED_FAST_PATHS) <= set(FAST_PATHS)
    missing = [name for name in contract_names() if not hasattr(family, name)]
    assert missing == []


@pytest.fixture
def refusing_family(monkeypatch):
    """Qwen2.5-VL's own functions under a family that refuses packing: a second family in one module."""
    module = types.ModuleType("lychee_pipeline.reranker.families.refusing")
    for name in contract_names():
        setattr(module, name, getattr(qwen2_5_vl, name))
    module.REFUSED_FAST_PATHS = {"pack_pairs": "its visual features are not placed in a packed sequence",
                                 "kernels": "liger does not know its modules"}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(families.FAMILIES, "qwen2_5_vl", "refusing")
    return module


def test_a_refused_fast_path_is_a_one_line_error_before_the_load(refusing_family, make_model):
    with pytest.raises(ValueError) as err:
        make_model(finetune="frozen", pack_pairs=True)
    assert str(err.value) == (
        "model.pack_pairs: the qwen2_5_vl family does not support pairs packed into one sequence (host-side vision "
        "inputs, features placed at the image rows): its visual features are not placed in a packed sequence; "
        "set model.pack_pairs: false")
    model = make_model(finetune="frozen", pack_pairs=False)  # the paths it keeps still load
    assert model.family is refusing_family


def test_refused_kernels_keep_the_plain_path_on_auto_and_fail_when_asked_for():
    assert resolve_kernels("auto", "cpu", "liger does not know its modules") == "none"
    with pytest.raises(RuntimeError, match=r"^model.kernels=liger: the model's family does not support it: liger "
                                           r"does not know its modules; use kernels=auto or none$"):
        resolve_kernels("liger", "cpu", "liger does not know its modules")


def test_a_loaded_model_finds_its_family(make_model):
    model = make_model(finetune="frozen")
    assert model.family is qwen2_5_vl and families.family_of_model(model.backbone) is qwen2_5_vl
    with pytest.raises(ValueError, match=r"^unknown fast path 'flash'; known: fast_path, pack_pairs, kernels, prefix_reuse$"):
        families.refused(qwen2_5_vl, "flash")
