"""``model.fp8`` (reranker/fp8.py): refused in one line where it cannot run (this CPU), and the conversion
itself checked on the CPU through torchao's emulation where torchao is installed (the ``gpu`` extra)."""

from __future__ import annotations

import pytest
import torch

from lychee_pipeline.reranker import fp8
from lychee_pipeline.reranker.model import ModelConfig, load_reranker


def test_fp8_is_refused_in_one_line_on_a_cpu(tiny_dir):
    cfg = ModelConfig(name_or_path="builtin:tiny", tiny_cache_dir=tiny_dir, finetune="frozen", fp8=True)
    with pytest.raises(RuntimeError) as info:
        load_reranker(cfg, device="cpu")
    message = str(info.value)
    assert "\n" not in message
    assert message == ("model.fp8 needs a Hopper GPU (CUDA capability 9.x: H100, H200); the device is 'cpu'; "
                       "set model.fp8: false")


def test_fp8_with_qlora_is_refused_naming_both_settings():
    assert fp8.fp8_refusal(torch.device("cpu"), "qlora").startswith("model.fp8 and finetune: qlora")


def test_fp8_emulated_covers_the_language_models_projections_only(make_model, images):
    """torchao's emulation on the CPU: every q/k/v/o and MLP projection of the language model becomes a
    Float8Linear (the vision tower and lm_head do not), the logits stay near the unconverted model's (float8 e4m3
    keeps ~2 significant digits), and LoRA adapters put around the FP8 base layers (as load_reranker does) get
    gradients while the base stays frozen."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (the gpu extra): FP8 not checked here")
    from torchao.float8.float8_linear import Float8Linear

    from lychee_pipeline.reranker.collate import PairCollator
    from lychee_pipeline.reranker.model import LoraConfig, _apply_lora

    model = make_model(finetune="frozen")
    model.eval()
    pairs = [({"text": "red shoes", "image": images["red"]}, {"text": f"doc {i} shoes " * (i + 1), "image": None})
             for i in range(3)]
    batch = model.host_inputs(PairCollator(model.processor)(pairs))
    with torch.no_grad():
        before = model(**batch)
    count = fp8.apply_fp8(model.backbone, model.family.language_models(model.backbone), emulate=True)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    layers = len(model.family.decoder_layers(model.backbone))
    assert count == len(converted) == 7 * layers  # q, k, v, o, gate, up, down of every decoder layer
    assert not any("visual" in name or "lm_head" in name for name in converted)
    with torch.no_grad():
        after = model(**batch)
    assert not torch.equal(after, before)  # the matmuls did go through float8 rounding
    torch.testing.assert_close(after, before, rtol=0.1, atol=0.1)

    model.backbone = _apply_lora(model.backbone, model.config.__class__(lora=LoraConfig(dropout=0.0)))
    model.train()
    model(**batch)[:, 0].sum().backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)


def test_fp8_on_a_lora_model_keeps_the_adapters_in_bf16(make_model):
    """Converted after peft (as ``train_step.py``'s ``+fp8`` lever does): only the frozen base layers change."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (the gpu extra): FP8 not checked here")
    from torchao.float8.float8_linear import Float8Linear

    model = make_model(finetune="lora")
    count = fp8.apply_fp8(model.backbone, model.family.language_models(model.backbone), emulate=True)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert count == 7 * len(model.family.decoder_layers(model.backbone))
    assert not any("lora_" in name for name in converted)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters() if "visual" not in n)
