"""The Qwen2.5-VL family module: one recipe for builtin:tiny and the benchmarks, lazy imports, image sizing."""

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from transformers import Qwen2_5_VLConfig

from lychee_pipeline.reranker import families
from lychee_pipeline.reranker.families import qwen2_5_vl
from lychee_pipeline.reranker.families.qwen2_5_vl import processor as qwen_processor, recipe

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _architecture(config) -> dict:
    """The dimensions of a config (what decides the shapes of the weights), without token ids and vocabulary."""
    text, vision = config.text_config.to_dict(), config.vision_config.to_dict()
    keep = set(recipe.ARCHITECTURES["tiny"]["text"]) | {"rope_parameters"}
    return {"text": {k: v for k, v in text.items() if k in keep},
            "vision": {k: v for k, v in vision.items() if k in set(recipe.ARCHITECTURES["tiny"]["vision"])
                       | {"out_hidden_size"}}}


def test_builtin_tiny_is_built_from_the_tiny_architecture(tiny_dir):
    saved = Qwen2_5_VLConfig.from_pretrained(tiny_dir)
    tok = qwen2_5_vl.load_processor(tiny_dir).tokenizer
    ids = {key: getattr(saved, key) for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                               "vision_end_token_id", "pad_token_id", "eos_token_id")}
    assert ids["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert recipe.token_ids_of(tok) == ids
    rebuilt = qwen2_5_vl.architecture_config("tiny", saved.text_config.vocab_size, ids)
    written_on_save = {"architectures", "dtype"}
    assert rebuilt.to_diff_dict() == {k: v for k, v in saved.to_diff_dict().items() if k not in written_on_save}


def test_the_benchmarks_tiny_config_is_builtin_tiny_s_architecture(tiny_dir, monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmarks_common", BENCHMARKS / "common.py")
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, common)  # its dataclasses look their module up there
    spec.loader.exec_module(common)
    saved = Qwen2_5_VLConfig.from_pretrained(tiny_dir)
    assert _architecture(common.build_config(tiny=True)) == _architecture(saved)
    seven_b = common.build_config(tiny=False)
    assert _architecture(seven_b) != _architecture(saved)
    assert seven_b.text_config.vocab_size == recipe.VOCAB_SIZE
    assert seven_b.image_token_id == common.IMAGE_TOKEN_ID


def test_unknown_sizes_token_ids_and_families_are_one_line_errors(tiny_dir):
    with pytest.raises(ValueError, match=r"^unknown Qwen2.5-VL size '3b'; known: 7b, tiny$"):
        qwen2_5_vl.architecture_config("3b")
    with pytest.raises(ValueError, match=r"^unknown token ids \['bos_id'\]"):
        qwen2_5_vl.architecture_config("tiny", token_ids={"bos_id": 1})
    with pytest.raises(ValueError, match=r"^no model family for model_type 'llama'; known: qwen2_5_vl, qwen3_vl$"):
        families.family_for("llama")
    assert families.family_of(tiny_dir) is qwen2_5_vl


def test_importing_the_library_builds_no_processor_and_imports_no_transformers():
    code = (
        "import sys\n"
        "import lychee_pipeline.reranker.model, lychee_pipeline.reranker.collate, lychee_pipeline.reranker.tiny\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_processor_shim_is_created_once_and_pickles_by_reference(tiny_dir):
    processor = qwen2_5_vl.load_processor(tiny_dir)
    shim = qwen_processor.processor_shim_class()
    assert qwen2_5_vl.LycheeProcessor is shim and qwen_processor.processor_shim_class() is shim
    if type(processor) is shim:  # no torchvision: the shim is what loaded
        copy = pickle.loads(pickle.dumps(processor))
        assert type(copy) is shim
        assert copy.tokenizer("red shoes")["input_ids"] == processor.tokenizer("red shoes")["input_ids"]
    saved = json.loads((Path(tiny_dir) / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2_5_VLProcessor"


@pytest.mark.parametrize("size", [(56, 56), (300, 90), (1000, 700)])
@pytest.mark.parametrize("max_pixels", [28 * 28 * 4, 28 * 28 * 64])
def test_image_tokens_is_the_processor_s_count(tiny_dir, size, max_pixels):
    processor = qwen2_5_vl.load_processor(tiny_dir)
    image = Image.new("RGB", size, (120, 30, 200))
    min_pixels = 28 * 28 * 4
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image],
                    size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, return_tensors="pt")
    counted = int((out["input_ids"] == processor.image_token_id).sum())
    assert qwen2_5_vl.image_tokens(processor, size[1], size[0], min_pixels, max_pixels) == counted
