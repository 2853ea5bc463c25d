"""The fast path (batched vision windows, frozen tower without autograd, selective checkpointing)
computes the same numbers as the stock Hugging Face path: fp32, on the CPU."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker.families import qwen2_5_vl, segments
from lychee_pipeline.reranker.families.qwen2_5_vl.checkpointing import checkpoint_layers_for_budget
from lychee_pipeline.reranker.collate import GroupCollator
from lychee_pipeline.reranker.losses import listwise_loss, pointwise_loss
from lychee_pipeline.reranker.model import enable_activation_checkpointing


def _tiny_vision(depth: int = 4):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 64, "vocab_size": 256,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": depth, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 32, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [1, depth - 1]},
    )
    vc = config.vision_config
    vc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(vc, attn_implementation="sdpa").float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _pixels(grids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=gen), torch.tensor(grids, dtype=torch.long)


def test_segment_plan_groups_by_length():
    # windows of 64, 64, 32, 64, 32 rows, then one image of 100 rows
    cu = torch.tensor([0, 64, 128, 160, 224, 256, 356], dtype=torch.int32)
    plan = segments.segment_plan(cu)
    by_len = {g.length: g for g in plan}
    assert set(by_len) == {64, 32, 100}
    g64 = by_len[64]
    assert g64.count == 3 and g64.start is None  # 0, 64, 160: not one run -> gathered
    assert g64.index.tolist() == list(range(0, 128)) + list(range(160, 224))
    assert by_len[32].count == 2 and by_len[32].index.tolist() == list(range(128, 160)) + list(range(224, 256))
    assert by_len[100].start == 256 and by_len[100].index is None
    assert segments.segment_plan(cu) is plan  # cached on the tensor


@pytest.mark.parametrize(
    "grids",
    [
        [[1, 32, 32]] * 3,  # 448x448 images: 16 windows of 64 patches each, one attention call
        [[1, 16, 16], [1, 12, 20], [1, 10, 6], [1, 8, 8], [1, 2, 2]],  # uneven windows: several lengths, gathered
    ],
)
def test_batched_windows_equal_stock_vision_tower(grids):
    model = _tiny_vision()
    pixels, grid = _pixels(grids)
    with torch.no_grad():
        stock = model(pixels, grid_thw=grid)
    # the patch embedding as a matmul sums in another order (its own test below): left out of this exact comparison
    handle = qwen2_5_vl.enable_fast_path(model, matmul_patch_embed=False)
    assert len(handle.attention_modules) == 4 and len(handle.vision_towers) == 1
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        fast = model(pixels, grid_thw=grid)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    torch.testing.assert_close(fast.pooler_output, stock.pooler_output, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast.last_hidden_state, stock.last_hidden_state, rtol=1e-6, atol=1e-6)
    assert not fast.pooler_output.requires_grad  # frozen tower ran without autograd
    if len(grids) == 3:
        # 2 window layers x 1 call (48 windows) + 2 full layers x 1 call (3 images), instead of 2 x 48 + 2 x 3
        assert calls == [48, 3, 48, 3]
    handle.disable()
    assert "forward" not in model.blocks[0].attn.__dict__ and "forward" not in model.__dict__


def test_fast_path_keeps_autograd_when_vision_trains():
    model = _tiny_vision(depth=2)
    for p in model.parameters():
        p.requires_grad_(True)
    pixels, grid = _pixels([[1, 16, 16], [1, 12, 8]], seed=1)
    stock = model(pixels, grid_thw=grid).pooler_output
    stock.square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    qwen2_5_vl.enable_fast_path(model)
    fast = model(pixels, grid_thw=grid).pooler_output
    assert fast.requires_grad
    fast.square().sum().backward()
    torch.testing.assert_close(fast, stock, rtol=1e-6, atol=1e-6)
    for g, r in zip((p.grad for p in model.parameters()), ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _rows(tmp_path, n_groups=2, group_size=4):
    gen = torch.Generator().manual_seed(3)
    sizes = [(224, 224), (168, 280), (112, 112), (196, 140)]
    rows = []
    for r in range(n_groups):
        docs = []
        for d in range(group_size):
            w, h = sizes[(r + d) % len(sizes)]
            path = tmp_path / f"img_{r}_{d}.png"
            Image.fromarray((torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()).save(path)
            docs.append({"doc_id": f"d{r}{d}", "text": f"document {d} of query {r}, red shoes " * (1 + d),
                         "image": str(path), "meta": "{}", "hard": True})
        rows.append({"record_id": f"r{r}", "query": {"text": f"query {r}: red running shoes", "image": None},
                     "positives": docs[:1], "negatives": docs[1:], "task_type": "t2it", "language": "en"})
    return rows


@pytest.mark.parametrize("loss_name", ["listwise", "pointwise"])
def test_fast_training_step_matches_stock_on_builtin_tiny(make_model, tmp_path, loss_name):
    """The project's step with the fast path + selective checkpointing = the stock step with full checkpointing."""
    model = make_model(finetune="lora", lora={"dropout": 0.0}, fast_path=False)  # stock first, fast path below
    collator = GroupCollator(model.processor, group_size=4)
    batch = collator(_rows(tmp_path))
    labels, group_size = batch.pop("labels"), batch.pop("group_size")
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # non-zero LoRA B, so every LoRA matrix gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(**batch)
        loss = listwise_loss(logits, group_size) if loss_name == "listwise" else pointwise_loss(logits, labels)
        loss.backward()
        return loss.detach(), logits.detach(), [p.grad.clone() for p in trainable]

    model.train()
    enable_activation_checkpointing(model.base_model)
    loss_ref, logits_ref, grads_ref = step()

    handle = qwen2_5_vl.enable_fast_path(model)
    assert handle.attention_modules and handle.vision_towers
    k = qwen2_5_vl.apply_selective_checkpointing(model, layers=1)
    assert k == 1
    flags = [layer.gradient_checkpointing for layer in qwen2_5_vl.decoder_layers(model)]
    assert flags == [True] + [False] * (len(flags) - 1)
    loss_fast, logits_fast, grads_fast = step()

    torch.testing.assert_close(logits_fast, logits_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_fast, loss_ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads_fast, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)

    # the stock forward (full logits) gives the same yes/no logits with the fast path on
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch), model.full_logits(**batch), rtol=1e-4, atol=1e-4)
    handle.disable()


def test_selective_checkpointing_counts(make_model):
    model = make_model(finetune="lora")
    n = len(qwen2_5_vl.decoder_layers(model))
    assert qwen2_5_vl.apply_selective_checkpointing(model, layers=None) == n
    assert qwen2_5_vl.apply_selective_checkpointing(model, layers=0.5) == (n + 1) // 2
    assert qwen2_5_vl.apply_selective_checkpointing(model, layers=0) == 0
    assert not any(layer.gradient_checkpointing for layer in qwen2_5_vl.decoder_layers(model))
    with pytest.raises(ValueError):
        qwen2_5_vl.apply_selective_checkpointing(model, layers=1.5)


def test_checkpoint_layers_for_budget():
    gib = 2**30
    # 28 layers, 8000 tokens, 1 MiB... per token-layer of activations -> each kept layer costs ~7.8 GiB/8
    per = 128 * 1024  # bytes per token per kept layer
    k = checkpoint_layers_for_budget(28, 8000, 40 * gib, 20 * gib, per, 8 * 1024)
    kept = 28 - k
    assert 20 * gib + 8000 * (kept * per + k * 8 * 1024) <= 40 * gib
    assert 20 * gib + 8000 * ((kept + 1) * per + (k - 1) * 8 * 1024) > 40 * gib
    assert checkpoint_layers_for_budget(28, 10, 40 * gib, 1 * gib, per) == 0
    assert checkpoint_layers_for_budget(28, 10**7, 40 * gib, 1 * gib, per) == 28


def test_patch_embedding_as_a_matmul_equals_the_convolution(family_model):
    """The patch embedding's Conv3d (stride == kernel) as one matmul over the flattened pixel rows: the same features
    in fp32, for both families' modules (Qwen3-VL's has a bias); Qwen2.5-VL's fast path switches it on and its
    disable restores the convolution, Qwen3-VL's keeps the convolution (qwen3_vl/vision.py says why)."""
    from lychee_pipeline.reranker.families import family_of_model
    from lychee_pipeline.reranker.families.patch_embed import (STOCK_FORWARD, disable_matmul_patch_embed,
                                                               enable_matmul_patch_embed, is_patchwise_conv)

    model = family_model()  # loaded with the fast path on (ModelConfig.fast_path)
    family = family_of_model(model)
    embeds = [m for m in model.modules() if type(m).__name__.endswith("PatchEmbed")]
    assert len(embeds) == 1 and is_patchwise_conv(embeds[0].proj)
    embed = embeds[0]
    assert (STOCK_FORWARD in embed.__dict__) == (family.NAME == "qwen2_5_vl")
    assert enable_matmul_patch_embed(model, (type(embed),)) == ([] if family.NAME == "qwen2_5_vl" else [embed])
    rows = torch.randn(40, embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.nn.init.normal_(embed.proj.weight)
        if embed.proj.bias is not None:
            torch.nn.init.normal_(embed.proj.bias)
        fast = embed(rows)
        stock = embed.__dict__[STOCK_FORWARD](rows)
    assert fast.shape == stock.shape == (40, embed.proj.out_channels)
    # sums of 1,176 (Qwen2.5-VL) or 1,536 (Qwen3-VL) products: only the fp32 summation order differs
    torch.testing.assert_close(fast, stock, rtol=0, atol=2e-6 * stock.abs().max().item())
    assert stock.abs().max() > 1
    family.disable_fast_path(model)
    if family.NAME != "qwen2_5_vl":
        assert disable_matmul_patch_embed(model) == 1
    assert "forward" not in embed.__dict__ and STOCK_FORWARD not in embed.__dict__


def test_only_patchwise_convolutions_become_matmuls():
    from lychee_pipeline.reranker.families.patch_embed import enable_matmul_patch_embed, is_patchwise_conv

    class Embed(torch.nn.Module):
        def __init__(self, stride):
            super().__init__()
            self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=stride, bias=False)

    overlapping, patchwise = Embed((1, 2, 2)), Embed((2, 4, 4))
    assert not is_patchwise_conv(overlapping.proj) and is_patchwise_conv(patchwise.proj)
    assert not is_patchwise_conv(torch.nn.Linear(3, 3))
    holder = torch.nn.ModuleList([overlapping, patchwise])
    assert enable_matmul_patch_embed(holder, (Embed,)) == [patchwise]
    assert enable_matmul_patch_embed(holder, (Embed,)) == []  # idempotent


def test_qwen3_vl_tower_attends_one_call_per_image_size(qwen3_dir):
    """Qwen3-VL's fast path runs its whole-image vision attention as one SDPA call per distinct image size (the stock
    forward: one per image): the same features in fp32, fewer calls; disable restores the stock forward."""
    from lychee_pipeline.reranker.families import qwen3_vl
    from lychee_pipeline.reranker.model import ModelConfig, load_reranker

    model = load_reranker(ModelConfig(name_or_path="builtin:tiny-qwen3-vl", tiny_cache_dir=qwen3_dir), device="cpu")
    tower = next(iter(qwen3_vl.model.vision_towers(model.backbone)))
    patch = 2 * 3 * tower.config.patch_size ** 2
    grids = [[1, 8, 8], [1, 8, 8], [1, 4, 12], [1, 8, 8]]
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, patch, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor(grids)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return sdpa(*args, **kwargs)

    def features():
        calls.clear()
        torch.nn.functional.scaled_dot_product_attention = counting
        try:
            with torch.no_grad():
                out = tower(pixels, grid_thw=grid)
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        return out.pooler_output, list(calls)

    fast, fast_calls = features()  # loaded with the fast path on
    qwen3_vl.disable_fast_path(model)
    stock, stock_calls = features()
    depth = len(tower.blocks)
    assert stock_calls == [1] * 4 * depth  # one call per image and layer
    assert sorted(fast_calls) == sorted([3, 1] * depth)  # the three 8x8 images in one call, the 4x12 in another
    torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5)
