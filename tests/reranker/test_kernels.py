"""``model.kernels`` / ``model.compile_layers`` (reranker/kernels.py): the CPU keeps the plain PyTorch path, and a
kernel choice this machine cannot run is a one-line error before the model loads."""

from __future__ import annotations

import logging

import pytest
import torch

from lychee_pipeline.reranker import kernels
from lychee_pipeline.reranker.families import qwen2_5_vl, qwen3_vl
from lychee_pipeline.reranker.families.qwen2_5_vl import decoder_layers


def _patched_modules(model) -> list[str]:
    """Modules whose forward was replaced on the instance (how liger-kernel patches a loaded model)."""
    return [name for name, m in model.named_modules() if "forward" in m.__dict__ and "Liger" in m._get_name()]


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto_keep_the_plain_path_on_cpu(make_model, choice, caplog):
    with caplog.at_level(logging.INFO, logger="lychee_pipeline.reranker.kernels"):
        model = make_model(kernels=choice)
    assert kernels.resolve_kernels(choice, "cpu") == "none"
    assert _patched_modules(model) == []
    layer = decoder_layers(model)[0]
    assert type(layer.mlp).__name__ == "Qwen2MLP" and "forward" not in layer.mlp.__dict__
    assert "forward" not in layer.input_layernorm.__dict__
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fused kernels")]
    assert len(lines) == 1 and "none" in lines[0]  # logged once


def test_liger_without_liger_is_a_one_line_error(make_model, monkeypatch):
    monkeypatch.setattr(kernels, "liger_installed", lambda: False)
    with pytest.raises(RuntimeError, match=r"kernels=liger needs liger-kernel") as info:
        make_model(kernels="liger")
    assert "\n" not in str(info.value)
    assert kernels.resolve_kernels("auto", "cuda") == "none"  # auto without liger: the plain path, no error


def test_liger_needs_cuda_and_unknown_choices_are_refused(monkeypatch):
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        kernels.resolve_kernels("liger", "cpu")
    assert kernels.resolve_kernels("auto", "cuda") == "liger"
    assert kernels.resolve_kernels("auto", "cpu") == "none"
    with pytest.raises(ValueError, match="must be one of"):
        kernels.resolve_kernels("triton", "cpu")


def test_compiled_layers_are_marked(make_model):
    model = make_model(compile_layers=True)
    layers = decoder_layers(model)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(make_model()))


@pytest.mark.parametrize("family", [qwen2_5_vl, qwen3_vl], ids=lambda f: f.NAME)
def test_vision_rotary_keeps_the_stock_function_on_a_cpu_and_remove_liger_puts_it_back(family, make_model):
    """The vision rotary replacement is process-wide once liger is applied on a GPU; a CPU tensor still gets
    transformers' own function (bit for bit), and :func:`remove_liger` puts the stock function back."""
    hf = family.fused_kernel_targets().modeling
    stock = hf.apply_rotary_pos_emb_vision
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, 2, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    half = torch.randn(10, 4, generator=gen)
    cos, sin = torch.cat([half.cos()] * 2, -1), torch.cat([half.sin()] * 2, -1)
    try:
        kernels._replace_rotary(hf, "apply_rotary_pos_emb_vision", kernels.vision_rotary_for(hf))
        assert hf.apply_rotary_pos_emb_vision is not stock and kernels.stock_vision_rotary(hf) is stock
        for ours, theirs in zip(hf.apply_rotary_pos_emb_vision(q, k, cos, sin), stock(q, k, cos, sin)):
            assert torch.equal(ours, theirs)
    finally:
        kernels.remove_liger(make_model(finetune="frozen"), family.fused_kernel_targets())
    assert hf.apply_rotary_pos_emb_vision is stock and kernels.stock_vision_rotary(hf) is stock


def test_liger_plan_covers_qwen2_5_vl_language_model_and_tower(make_model):
    """Every Qwen2.5-VL RMSNorm (language model, vision blocks, merger) and every gated MLP (both SiLU)."""
    model = make_model(finetune="frozen")
    plan = kernels.liger_plan(model, qwen2_5_vl.fused_kernel_targets())
    layers = decoder_layers(model)
    blocks = model.base_model.model.visual.blocks
    assert len(plan.rms_norms) == 2 * len(layers) + 1 + 2 * len(blocks) + 1  # + the final norm, the merger's ln_q
    assert {id(m) for m in plan.swiglu_mlps} == {id(m.mlp) for m in [*layers, *blocks]} and plan.plain_mlps == []


def test_the_padded_mlp_equals_the_stock_mlp_and_only_misaligned_widths_take_it():
    """kernels.pad_gated_mlps: an MLP whose intermediate width is not a multiple of 64 (Qwen2.5-VL's vision MLP:
    3,420) scores through zero-padded copies that compute the stock output (fp32, CPU: the padding adds exactly
    nothing); a 64-wide one is left alone; on a CPU tensor the MLP runs its own forward and keeps no copies."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    torch.manual_seed(0)
    mlps = [Qwen2_5_VLMLP(Qwen2_5_VLConfig(vision_config={"hidden_size": 32, "intermediate_size": width}).vision_config,
                          bias=True).eval().requires_grad_(False) for width in (90, 64)]
    x = torch.randn(7, 32)
    stock = [mlp(x) for mlp in mlps]
    assert kernels.pad_gated_mlps(mlps) == 1 and kernels.pad_gated_mlps(mlps) == 0  # idempotent
    assert "forward" in mlps[0].__dict__ and "forward" not in mlps[1].__dict__
    with torch.no_grad():
        weights = kernels.padded_mlp_weights(mlps[0])
        assert weights[0].shape == (2 * 128, 32) and weights[2].shape == (32, 128)
        torch.testing.assert_close(kernels.padded_mlp_forward(mlps[0], weights, x), stock[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(mlps[0](x), stock[0]) and kernels._PADDED not in mlps[0].__dict__  # CPU: its own forward


def test_the_padded_path_holds_only_for_a_frozen_plain_mlp_in_eval_and_its_copies_follow_the_weights():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    config = Qwen2_5_VLConfig(vision_config={"hidden_size": 32, "intermediate_size": 90}).vision_config
    mlp = Qwen2_5_VLMLP(config, bias=True).eval().requires_grad_(False)
    assert kernels.padded_path_holds(mlp)
    assert not kernels.padded_path_holds(mlp.train()) and kernels.padded_path_holds(mlp.eval())
    mlp.up_proj.weight.requires_grad_(True)
    assert not kernels.padded_path_holds(mlp)  # a trainable weight: its own forward
    mlp.requires_grad_(False)

    class Adapted(torch.nn.Linear):  # stands for a LoRA-wrapped projection: the copies would skip its adapter
        pass

    plain = mlp.down_proj
    mlp.down_proj = Adapted(90, 32)
    assert not kernels.padded_path_holds(mlp)
    mlp.down_proj = plain
    first = kernels.padded_weights(mlp)
    assert kernels.padded_weights(mlp) is first  # kept
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(2)  # changed in place: its version moves
    second = kernels.padded_weights(mlp)
    assert second is not first and torch.equal(second[0][:90], mlp.gate_proj.weight)


def test_disabling_the_fast_path_leaves_the_padding_and_its_saved_forward(make_model):
    """The fast path's restore_forward and the padding keep their replaced forwards under different keys."""
    from lychee_pipeline.reranker.families.base import ORIG_FORWARD

    model = make_model(finetune="frozen")
    mlp = model.base_model.model.visual.blocks[0].mlp
    own = mlp.forward
    assert kernels.pad_gated_mlps([mlp]) == 0  # the tiny tower's MLP is 64 wide: aligned, left alone
    mlp.gate_proj, mlp.up_proj = (torch.nn.Linear(32, 90, bias=True) for _ in range(2))
    mlp.down_proj = torch.nn.Linear(90, 32, bias=True)
    assert kernels.pad_gated_mlps([mlp]) == 1
    qwen2_5_vl.disable_fast_path(model)
    assert kernels.UNPADDED_FORWARD in mlp.__dict__ and ORIG_FORWARD not in mlp.__dict__
    assert mlp.__dict__[kernels.UNPADDED_FORWARD] == own
