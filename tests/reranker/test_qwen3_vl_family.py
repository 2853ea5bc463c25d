"""The Qwen3-VL family (Qwen3-VL-Reranker) on builtin:tiny-qwen3-vl: the prompt's tokens for each pair kind, the
score against a hand computation, a saved folder scoring the same, the fast paths it refuses, and the pieces
training uses (LoRA targets, checkpointing through the family)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker import families
from lychee_pipeline.reranker.collate import GroupCollator, PairCollator
from lychee_pipeline.reranker.families import qwen3_vl
from lychee_pipeline.reranker.inference import Reranker
from lychee_pipeline.reranker.kernels import liger_plan, resolve_kernels
from lychee_pipeline.reranker.model import ModelConfig, load_reranker, resolve_model_path
from lychee_pipeline.reranker.processing import ProcessingConfig
from lychee_pipeline.reranker.tiny import TINY_MODELS, recipe_hash, tiny_dir

NAME = "builtin:tiny-qwen3-vl"
SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
BUDGET = {"min_pixels": 4 * 32 * 32, "max_pixels": 1800 * 32 * 32}  # Qwen3-VL-Reranker's


@pytest.fixture
def make_qwen3(qwen3_dir):
    def make(**overrides):
        overrides.setdefault("pack_pairs", "auto")
        return load_reranker(ModelConfig(name_or_path=NAME, tiny_cache_dir=qwen3_dir, **overrides), device="cpu")

    return make


def picture(width: int, height: int, colour=(200, 30, 30)) -> Image.Image:
    return Image.new("RGB", (width, height), colour)


def vision(tokens: int) -> str:
    return "<|vision_start|>" + "<|image_pad|>" * tokens + "<|vision_end|>"


def expected(query: str, doc: str) -> str:
    """The Qwen3-VL-Reranker prompt written out by hand (chat template with the generation prompt)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n<Instruct>: {INSTRUCTION}<Query>:{query}"
            f"\n<Document>:{doc}<|im_end|>\n<|im_start|>assistant\n")


# 64 x 96 pixels at patch 16, merge 2 (factor 32): 2 x 3 = 6 tokens; 128 x 128: 4 x 4 = 16 tokens
WIDE, SQUARE = picture(96, 64), picture(128, 128, (10, 200, 10))
PAIR_KINDS = {
    "text-text": (({"text": "red shoes"}, {"text": "a red running shoe"}), expected("red shoes", "a red running shoe")),
    "text-image": (({"text": "red shoes"}, {"image": WIDE}), expected("red shoes", vision(6))),
    "image-text": (({"image": SQUARE}, {"text": "green box"}), expected(vision(16), "green box")),
    "both-both": (({"text": "red shoes", "image": WIDE}, {"text": "green box", "image": SQUARE}),
                  expected(vision(6) + "red shoes", vision(16) + "green box")),
    "empty-query": (({"text": None, "image": None}, {"text": "green box"}), expected("NULL", "green box")),
    "empty-document": (({"text": "red shoes"}, {"text": ""}), expected("red shoes", "NULL")),
}


@pytest.mark.parametrize("kind", sorted(PAIR_KINDS))
def test_each_pair_kind_renders_the_qwen3_vl_reranker_prompt(make_qwen3, kind):
    model = make_qwen3(finetune="frozen")
    pair, text = PAIR_KINDS[kind]
    batch = PairCollator(model.processor, family=model.family.NAME, **BUDGET)([pair])
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    assert model.processor.tokenizer.decode(ids) == text
    image_rows = int((ids == model.processor.image_token_id).sum())
    assert image_rows == text.count("<|image_pad|>")
    if "image_grid_thw" in batch:  # the processor's grid gives the same count (one token per 2 x 2 patches)
        assert image_rows == int(batch["image_grid_thw"].prod(dim=1).sum()) // 4


def test_a_pair_without_an_instruction_of_its_own_gets_the_family_default_for_every_task_type(make_qwen3):
    model = make_qwen3(finetune="frozen")
    collator = PairCollator(model.processor, family="qwen3_vl", instructions={"t2i": "find the picture"})
    assert collator.instruction_for("t2t") == INSTRUCTION and collator.instruction_for("i2it") == INSTRUCTION
    assert collator.instruction_for("t2i") == "find the picture"
    assert PairCollator(model.processor).instruction_for("t2t") != INSTRUCTION  # Lychee's table by default


def test_an_empty_side_is_refused_by_the_lychee_prompt(make_model):
    model = make_model(finetune="frozen", pack_pairs=False)
    with pytest.raises(ValueError, match=r"^an item needs a non-empty 'text' or an 'image'"):
        PairCollator(model.processor)([({"text": None}, {"text": "doc"})])


def test_a_long_pair_is_cut_in_its_text_never_its_image_tokens_and_keeps_the_prompt_end(make_qwen3):
    model = make_qwen3(finetune="frozen")
    collator = PairCollator(model.processor, family="qwen3_vl", max_length=150, **BUDGET)
    long_text = " ".join(["red running shoes for women with a breathable mesh upper"] * 30)
    batch = collator([({"text": "red shoes"}, {"text": long_text, "image": SQUARE})])
    ids = batch["input_ids"][0]
    assert ids.shape[0] == 150 and collator.stats.truncated_pairs == 1
    assert int((ids == model.processor.image_token_id).sum()) == 16
    text = model.processor.tokenizer.decode(ids)
    assert text.endswith(" upper<|im_end|>\n<|im_start|>assistant\n")  # the document text's end cut
    assert text.count("red running shoes") < 30 and "<Query>:red shoes\n<Document>:" + vision(16) in text


def test_the_score_is_the_sigmoid_of_the_last_hidden_state_times_the_yes_minus_no_rows(make_qwen3):
    model = make_qwen3(finetune="frozen", dtype="fp32")
    pairs = [pair for pair, _ in PAIR_KINDS.values()]
    batch = PairCollator(model.processor, family="qwen3_vl", **BUDGET)(pairs)
    with torch.no_grad():
        scored = model.probabilities(model(**batch))
        hf = model.base_model
        out = hf(**batch, use_cache=False, output_hidden_states=True, return_dict=True)
        h = hf.model(**batch, use_cache=False, return_dict=True).last_hidden_state[:, -1, :]
        w = hf.lm_head.weight
        tok = model.processor.tokenizer
        yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
        by_hand = torch.sigmoid(h @ (w[yes] - w[no]))
        stock = torch.softmax(out.logits[:, -1, [yes, no]], dim=-1)[:, 0]  # the full-vocabulary forward
    assert scored.dtype == torch.float32
    torch.testing.assert_close(scored, by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(scored, stock, rtol=0, atol=1e-6)
    assert float(scored.max() - scored.min()) > 1e-4  # the pairs score differently: not a constant


def test_a_saved_adapter_folder_scores_the_same_and_carries_its_processing_settings(make_qwen3, qwen3_dir, tmp_path):
    model = make_qwen3(finetune="lora")
    with torch.no_grad():  # an adapter that changes the scores (LoRA's B starts at zero)
        for name, param in model.backbone.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    pairs = [pair for pair, _ in PAIR_KINDS.values()]
    processing = ProcessingConfig(max_length=4096, **BUDGET)
    before = Reranker(model, batch_size=4, **{k: v for k, v in processing.as_dict().items()}).score_pairs(pairs)
    model.save_pretrained(tmp_path / "adapter", processing=processing)
    meta = json.loads((tmp_path / "adapter" / "lychee_reranker.json").read_text())
    assert meta["format"] == "adapter" and meta["base_model"] == NAME
    assert json.loads((tmp_path / "adapter" / "processor_config.json").read_text())["processor_class"] \
        == "Qwen3VLProcessor"
    reloaded = Reranker.from_pretrained(str(tmp_path / "adapter"), device="cpu", batch_size=4, tiny_cache_dir=qwen3_dir)
    assert reloaded.model.family is qwen3_vl and reloaded.processing == processing
    after = reloaded.score_pairs(pairs)
    assert after == pytest.approx(before, abs=1e-6)
    base = Reranker.from_pretrained(NAME, device="cpu", batch_size=4, tiny_cache_dir=qwen3_dir)
    assert max(abs(a - b) for a, b in zip(base.score_pairs(pairs), after)) > 1e-4  # the adapter was applied
    # a folder without saved settings scores with the published model's (not Lychee's 28-pixel budget)
    assert base.processing == ProcessingConfig(max_length=10240, **BUDGET)


def test_liger_targets_the_language_model_and_auto_packs(make_qwen3):
    """liger's kernels go to the language model's RMSNorms (the per-head q/k norms among them) and SiLU-gated MLPs;
    the tower's LayerNorms and GELU MLPs keep their modules. ``auto`` keeps the plain path on a CPU; packing holds
    for this family (its DeepStack features placed at the packed image rows: tests/reranker/test_packing.py)."""
    model = make_qwen3(finetune="frozen")
    assert families.refused(qwen3_vl, "kernels") is None
    assert resolve_kernels("auto", "cpu", families.refused(qwen3_vl, "kernels")) == "none"
    plan = liger_plan(model, qwen3_vl.fused_kernel_targets())
    layers = qwen3_vl.decoder_layers(model.base_model)
    assert len(plan.rms_norms) == 4 * len(layers) + 1  # input, post-attention, q and k norms; the final norm
    assert {id(layer.self_attn.q_norm) for layer in layers} <= {id(n) for n in plan.rms_norms}
    assert [id(m) for m in plan.swiglu_mlps] == [id(layer.mlp) for layer in layers] and plan.plain_mlps == []
    tower = qwen3_vl.model.vision_towers(model.base_model)[0]
    assert not {id(m) for m in tower.modules()} & {id(m) for m in plan.rms_norms + plan.swiglu_mlps}
    assert families.refused(qwen3_vl, "pack_pairs") is None
    assert model.config.pack_pairs is True  # auto: packed pairs
    assert make_qwen3(finetune="frozen", pack_pairs=False).config.pack_pairs is False


def test_pack_pairs_auto_still_packs_the_qwen2_5_vl_family(make_model):
    assert make_model(finetune="frozen", pack_pairs="auto").config.pack_pairs is True


def test_lora_trains_the_language_model_only_and_checkpointing_goes_through_the_family(make_qwen3, images):
    model = make_qwen3(finetune="lora")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "visual" not in n for n in trainable)
    assert any("language_model" in n for n in trainable)
    assert model.family.apply_selective_checkpointing(model, layers=2) == 2
    layers = model.family.decoder_layers(model.base_model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, True, False]
    rows = [{"record_id": "r1", "task_type": "t2i", "query": {"text": "red"},
             "positives": [{"doc_id": "p", "image": images["red"]}],
             "negatives": [{"doc_id": f"n{i}", "image": images[c], "hard": True}
                           for i, c in enumerate(("blue", "green", "wide"))]}]
    batch = GroupCollator(model.processor, group_size=4, family=model.family.NAME)(rows)
    logits = model(**batch)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1, 1]))
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    tower = families.qwen3_vl.model.vision_towers(model.base_model)[0]
    assert all(p.grad is None for p in tower.parameters())  # the frozen tower ran without autograd


def test_full_fine_tuning_keeps_the_tower_frozen_by_default(make_qwen3):
    model = make_qwen3(finetune="full")
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lm_head" in n for n in names) and not any("visual" in n for n in names)


def test_the_tiny_folder_is_a_stock_qwen3_vl_folder_of_its_own(qwen3_dir, tmp_path, monkeypatch):
    config = json.loads((Path(qwen3_dir) / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert config["vision_config"]["patch_size"] == 16 and config["vision_config"]["spatial_merge_size"] == 2
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    assert config["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert families.family_of(qwen3_dir) is qwen3_vl
    assert json.loads((Path(qwen3_dir) / "lychee_tiny.json").read_text())["name"] == NAME
    assert recipe_hash(NAME) != recipe_hash("builtin:tiny")
    monkeypatch.setenv("LYCHEE_TINY_DIR", str(tmp_path / "tiny"))
    assert tiny_dir(name=NAME) == tmp_path / "tiny_qwen3_vl" and tiny_dir() == tmp_path / "tiny"
    assert set(TINY_MODELS) == {"builtin:tiny", NAME}
    with pytest.raises(ValueError, match=r"^unknown built-in model 'builtin:tiny-qwen4'; known: builtin:tiny, "
                                         r"builtin:tiny-qwen3-vl$"):
        resolve_model_path("builtin:tiny-qwen4")


def test_the_published_sizes_build_configs_with_their_dimensions():
    two, eight = qwen3_vl.architecture_config("2b"), qwen3_vl.architecture_config("8b")
    assert (two.text_config.hidden_size, two.text_config.num_hidden_layers, two.vision_config.out_hidden_size) \
        == (2048, 28, 2048)
    assert (eight.text_config.hidden_size, eight.text_config.num_hidden_layers, eight.vision_config.depth) \
        == (4096, 36, 27)
    assert two.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
    with pytest.raises(ValueError, match=r"^unknown Qwen3-VL size '4b'; known: 2b, 8b, tiny$"):
        qwen3_vl.architecture_config("4b")


def test_the_benchmarks_build_qwen3_vl_and_feed_it_patch_16_groups(monkeypatch):
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("benchmarks_common_qwen3", path)
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, common)
    spec.loader.exec_module(common)
    with pytest.raises(SystemExit, match=r"^--size: qwen3_vl has sizes 2b, 8b, not '7b'$"):
        common.select_architecture("qwen3_vl", "7b")
    common.select_architecture("qwen3_vl", "8b")
    assert common.build_config().text_config.num_hidden_layers == 36 and common.patch_size() == 16
    model = common.build_model(common.build_config(tiny=True), torch.device("cpu"), torch.float32)
    assert model.config.model_type == "qwen3_vl"
    group = common.synthetic_group(common.Shape(group_size=2, text_tokens=40, image_side=64, query_tokens=8), seed=0)
    assert group["pixel_values"].shape[1] == 3 * 2 * 16 * 16 and group["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    with torch.no_grad():
        out = model.model(**{k: v for k, v in group.items() if k not in ("labels", "group_size")})
    assert out.last_hidden_state.shape[0] == 2 and torch.isfinite(out.last_hidden_state).all()
