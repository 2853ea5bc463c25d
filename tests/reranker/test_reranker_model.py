"""Model loading and the 2-way head."""

import re

import pytest
import torch

from lychee_pipeline.reranker import LycheeReranker, ModelConfig, PairCollator, load_reranker
from lychee_pipeline.reranker.model import DEFAULT_LORA_TARGETS, resolve_model_path


def _pairs(images):
    return [
        ({"text": "red shoes", "image": None}, {"text": "red running shoes for women", "image": None}),
        ({"text": None, "image": images["red"]}, {"text": "a blue bag", "image": images["blue"]}),
        ({"text": "green", "image": None}, {"text": None, "image": images["wide"]}),
    ]


def test_two_way_head_equals_full_logits(make_model, images):
    model = make_model(finetune="frozen")
    batch = PairCollator(model.processor)(_pairs(images))
    with torch.no_grad():
        head = model(**batch)
        full = model.full_logits(**batch)
    assert isinstance(model, LycheeReranker)
    assert head.shape == (3, 2) and head.dtype == torch.float32
    torch.testing.assert_close(head, full, rtol=0, atol=1e-5)
    assert not torch.allclose(head[0], head[1])  # different pairs, different logits


def test_forward_ignores_training_keys_and_requires_left_padding(make_model, images):
    model = make_model(finetune="frozen", pack_pairs=False)  # the padded forward reads the last position
    batch = PairCollator(model.processor)(_pairs(images))
    with torch.no_grad():
        plain = model(**batch)
        with_labels = model(**batch, labels=torch.ones(3), group_size=3)
    torch.testing.assert_close(plain, with_labels)
    assert "mm_token_type_ids" in batch
    right = dict(batch)
    right["attention_mask"] = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="left padded"):
        model(**right)


def test_lora_targets_language_model_attention_only(make_model):
    model = make_model(finetune="lora")
    lora_modules = {n.rsplit(".lora_", 1)[0] for n, _ in model.named_parameters() if ".lora_" in n}
    assert lora_modules, "no LoRA layers were created"
    assert all(re.search(r"\.(q|k|v|o)_proj$", n) for n in lora_modules)
    assert not any("visual" in n for n in lora_modules)
    n_layers = model.base_model.config.text_config.num_hidden_layers
    assert len(lora_modules) == 4 * n_layers
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert re.fullmatch(DEFAULT_LORA_TARGETS, "model.visual.blocks.0.attn.q_proj") is None
    assert model.training


def test_full_and_frozen_modes(make_model):
    full = make_model(finetune="full")
    named = dict(full.named_parameters())
    assert all(p.requires_grad for n, p in named.items() if "visual" not in n)
    assert not any(p.requires_grad for n, p in named.items() if "visual" in n)
    frozen = make_model(finetune="frozen")
    assert not any(p.requires_grad for p in frozen.parameters())
    assert not frozen.training


def test_activation_checkpointing_gives_the_same_gradients(make_model, images):
    torch.manual_seed(0)
    grads = []
    for ckpt in (False, True):
        model = make_model(finetune="lora", lora={"dropout": 0.0}, activation_checkpointing=ckpt)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.trainable_parameters():
                p.copy_(torch.randn_like(p) * 0.05)
        batch = PairCollator(model.processor)(_pairs(images))
        model(**batch)[:, 0].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.trainable_parameters()]))
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == ckpt
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_qlora_on_cpu_fails_clearly(tiny_dir):
    cfg = ModelConfig(name_or_path="builtin:tiny", finetune="qlora", tiny_cache_dir=tiny_dir)
    with pytest.raises(RuntimeError, match="QLoRA .*needs a CUDA GPU and bitsandbytes"):
        load_reranker(cfg, device="cpu")


def test_config_validation_and_path_resolution(tmp_path):
    with pytest.raises(ValueError, match="finetune"):
        ModelConfig(finetune="adapter-ish")
    with pytest.raises(ValueError, match="trust_remote_code"):
        ModelConfig(trust_remote_code=True)
    assert resolve_model_path("vec-ai/lychee-rerank-mm") == "vec-ai/lychee-rerank-mm"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="builtin"):
        resolve_model_path("builtin:huge")
