"""builtin:tiny: a real Qwen2.5-VL folder, built deterministically, rebuilt only when the recipe changes."""

import hashlib
import json
from pathlib import Path

from transformers import Qwen2_5_VLConfig

from lychee_pipeline.reranker import tiny
from lychee_pipeline.reranker.families.qwen2_5_vl import load_processor
from lychee_pipeline.reranker.model import resolve_model_path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_folder_is_a_stock_qwen2_5_vl_folder(tiny_dir):
    folder = Path(tiny_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", tiny.MARKER_FILE):
        assert (folder / name).is_file(), name
    assert not list(folder.glob("*.bin"))
    config = Qwen2_5_VLConfig.from_pretrained(folder)
    processor = load_processor(str(folder))
    tok = processor.tokenizer
    # the vision token ids in the config are the tokenizer's
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert len(tok) <= text.vocab_size
    assert tok.padding_side == "left"  # saved, not just set in memory
    assert json.loads((folder / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"


def test_tiny_tokenizer_encodes_any_text_and_has_whole_answer_tokens(tiny_dir):
    tok = load_processor(tiny_dir).tokenizer
    for word in ("yes", "no"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1
    for text in ("Red running shoes, size 42!", "红色女士跑步鞋，透气网面", "émoji 😀 mixed 中文 text"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_builtin_tiny_resolves_to_the_cache_and_is_not_rebuilt(tiny_dir):
    folder = Path(resolve_model_path("builtin:tiny", tiny_cache_dir=tiny_dir))
    assert folder == Path(tiny_dir)
    before = (folder / "model.safetensors").stat().st_mtime_ns
    tiny.ensure_tiny(tiny_dir)
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_build_is_deterministic_and_stale_marker_triggers_rebuild(tiny_dir, tmp_path, monkeypatch):
    other = tiny.ensure_tiny(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert _digest(other / name) == _digest(Path(tiny_dir) / name), name
    marker = other / tiny.MARKER_FILE
    data = json.loads(marker.read_text())
    data["recipe_hash"] = "something-else"
    marker.write_text(json.dumps(data))
    assert not tiny.is_current(other)
    tiny.ensure_tiny(other)
    assert tiny.is_current(other)
    assert _digest(other / "model.safetensors") == _digest(Path(tiny_dir) / "model.safetensors")


def test_default_cache_dir_and_env_override(monkeypatch, tmp_path):
    monkeypatch.delenv(tiny.TINY_DIR_ENV, raising=False)
    assert tiny.tiny_dir() == Path("data/06_models/builtin_tiny")
    monkeypatch.setenv(tiny.TINY_DIR_ENV, str(tmp_path / "x"))
    assert tiny.tiny_dir() == tmp_path / "x"
