"""Packing a group's pairs into one sequence (reranker/packing.py) computes what the padded path computes:
fp32 on the CPU, the built-in tiny Qwen2.5-VL and (``family_model``) the tiny Qwen3-VL, whose DeepStack adds
vision-layer features at the image rows of its first decoder layers; pairs of different lengths, with and without
images (so the 3-D mRoPE positions matter)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker import packing
from lychee_pipeline.reranker.collate import GroupCollator, PairCollator
from lychee_pipeline.reranker.inference import Reranker
from lychee_pipeline.reranker.losses import listwise_loss
from lychee_pipeline.reranker.model import ModelConfig, load_reranker

QWEN3 = "builtin:tiny-qwen3-vl"


def _image(path, w, h, seed):
    gen = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()).save(path)
    return str(path)


def _rows(tmp_path, n_groups=2, group_size=4, images=True):
    """Groups whose documents differ in length; every second document has an image of its own size, and the
    first group's query has an image too (image and text-only pairs mixed in one batch)."""
    sizes = [(224, 224), (168, 280), (112, 112), (196, 140)]
    rows = []
    for r in range(n_groups):
        docs = []
        for d in range(group_size):
            w, h = sizes[(r + d) % len(sizes)]
            image = _image(tmp_path / f"img_{r}_{d}.png", w, h, 10 * r + d) if images and d % 2 == 0 else None
            docs.append({"doc_id": f"d{r}{d}", "text": f"document {d} of query {r}, red shoes " * (1 + 2 * d),
                         "image": image, "meta": "{}", "hard": True})
        query_image = _image(tmp_path / f"q_{r}.png", 140, 112, 99 + r) if images and r == 0 else None
        rows.append({"record_id": f"r{r}", "query": {"text": f"query {r}: red running shoes", "image": query_image},
                     "positives": docs[:1], "negatives": docs[1:], "task_type": "t2it", "language": "en"})
    return rows


def _pair_of_models(make_model, **overrides):
    """The padded reference and a packed model with the same weights (LoRA B non-zero: every LoRA matrix
    then gets a gradient)."""
    padded = make_model(lora={"dropout": 0.0}, pack_pairs=False, **overrides)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for name, p in padded.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    packed = make_model(lora={"dropout": 0.0}, pack_pairs=True, **overrides)
    packed.load_state_dict(padded.state_dict())
    return padded, packed


def _model_batch(batch):
    return {k: v for k, v in batch.items() if k not in ("labels", "group_size")}


def test_pack_inputs_layout(make_model, tmp_path):
    model = make_model(pack_pairs=True)
    batch = GroupCollator(model.processor, group_size=4)(_rows(tmp_path, n_groups=1))
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) > 1  # pairs of different lengths, so the padded batch has padding
    inputs, plan, last = packing.pack_inputs(model.base_model.model, _model_batch(batch))
    assert plan.lengths == tuple(lengths)
    assert inputs["input_ids"].shape == (1, sum(lengths))
    assert inputs["position_ids"].shape == (4, 1, sum(lengths))
    assert last.tolist() == [e - 1 for e in plan.ends]
    text = inputs["position_ids"][0, 0]
    for start, end in zip(plan.starts, plan.ends):  # text positions restart at 0 for every pair
        assert text[start:end].tolist() == list(range(end - start))
    # the packed tokens are the real tokens of the rows, in row order
    real = torch.cat([row[mask.bool()] for row, mask in zip(batch["input_ids"], batch["attention_mask"])])
    assert torch.equal(inputs["input_ids"][0], real)
    # image tokens carry 3-D positions that differ from the text positions (mRoPE is in play)
    image_rows = inputs["mm_token_type_ids"][0] == 1
    assert image_rows.any()
    assert not torch.equal(inputs["position_ids"][2, 0][image_rows], text[image_rows])


@pytest.mark.parametrize("images", [True, False], ids=["images", "text_only"])
def test_packed_scores_equal_padded(family_model, tmp_path, images):
    padded, packed = _pair_of_models(family_model)
    batch = _model_batch(GroupCollator(padded.processor, group_size=4)(_rows(tmp_path, images=images)))
    assert bool((batch["attention_mask"] == 0).any())  # the padded path really pads
    padded.eval()
    packed.eval()
    with torch.no_grad():
        ref = padded(**batch)
        out = packed(**batch)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_packed_scores_need_the_mrope_positions(make_model, tmp_path):
    """The check above can fail: packing with plain 1-D positions for the image tokens changes the scores."""
    padded, packed = _pair_of_models(make_model)
    batch = _model_batch(GroupCollator(padded.processor, group_size=4)(_rows(tmp_path)))
    packed.eval()
    vl = packed.base_model.model
    inputs, plan, last = packing.pack_inputs(vl, batch)
    text_only = inputs["position_ids"][0:1].expand(3, -1, -1)
    with torch.no_grad():
        right = vl(**{**inputs, "position_ids": inputs["position_ids"][1:]}, use_cache=False,
                   **{packing.PLAN_KWARG: plan.as_tensor()}).last_hidden_state[0, last]
        wrong = vl(**{**inputs, "position_ids": text_only}, use_cache=False,
                   **{packing.PLAN_KWARG: plan.as_tensor()}).last_hidden_state[0, last]
    assert (right - wrong).abs().max() > 1e-3


def test_packed_qwen3_scores_need_the_deepstack_features(qwen3_dir, tmp_path, monkeypatch):
    """The Qwen3-VL check above can fail: a packed forward without DeepStack (the vision-layer features added at the
    image rows of the first decoder layers) gives other scores than the padded path."""
    def make(**overrides):
        return load_reranker(ModelConfig(name_or_path=QWEN3, tiny_cache_dir=qwen3_dir, **overrides), device="cpu")

    padded, packed = _pair_of_models(make)
    batch = _model_batch(GroupCollator(padded.processor, group_size=4)(_rows(tmp_path)))
    padded.eval()
    packed.eval()
    monkeypatch.setattr(packing, "_deepstack_inputs", lambda *args: {})
    with torch.no_grad():
        assert (packed(**batch) - padded(**batch)).abs().max() > 1e-3


def test_packed_group_of_one_pair(family_model, tmp_path):
    padded, packed = _pair_of_models(family_model)
    row = _rows(tmp_path, n_groups=1)[0]  # a micro-batch of one pair (the scorer's last batch can be one)
    batch = PairCollator(padded.processor)([(row["query"], row["positives"][0])])
    assert batch["input_ids"].shape[0] == 1 and batch["pixel_values"] is not None
    padded.eval()
    packed.eval()
    with torch.no_grad():
        torch.testing.assert_close(packed(**batch), padded(**batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("checkpoint_layers", [None, 1], ids=["no_checkpointing", "one_layer_checkpointed"])
def test_packed_gradients_equal_padded(family_model, tmp_path, checkpoint_layers):
    """A listwise loss on the scores, backward: the LoRA gradients of the packed step equal the padded step's
    (also with a checkpointed layer, whose recompute in backward must see the same pairs)."""
    padded, packed = _pair_of_models(family_model)
    batch = GroupCollator(padded.processor, group_size=4)(_rows(tmp_path))
    group_size = batch["group_size"]
    inputs = _model_batch(batch)

    def grads(model):
        if checkpoint_layers is not None:
            model.family.apply_selective_checkpointing(model, layers=checkpoint_layers)
        model.train()
        model.zero_grad(set_to_none=True)
        loss = listwise_loss(model(**inputs), group_size)
        loss.backward()
        named = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return loss.detach(), named

    loss_ref, ref = grads(padded)
    loss_out, out = grads(packed)
    torch.testing.assert_close(loss_out, loss_ref, rtol=1e-5, atol=1e-6)
    assert ref.keys() == out.keys() and any("lora_A" in n for n in ref)
    for name, g in ref.items():
        assert g.abs().max() > 0, name
        rel = (out[name] - g).norm() / g.norm()
        assert rel < 1e-5, (name, float(rel))


def test_scoring_with_packing_equals_padded(family_model, tmp_path):
    """The scoring path (Reranker.score_pairs: sorted batches, a host thread ahead) gives the padded scores."""
    padded, packed = _pair_of_models(family_model, finetune="frozen")
    rows = _rows(tmp_path, n_groups=2)
    pairs = [(row["query"], doc) for row in rows for doc in row["positives"] + row["negatives"]]
    scores = {}
    for name, model in (("padded", padded), ("packed", packed)):
        model.eval()
        scores[name] = Reranker(model, batch_size=3, max_pixels=64 * 28 * 28).score_pairs(pairs)
    torch.testing.assert_close(torch.tensor(scores["packed"]), torch.tensor(scores["padded"]), rtol=0, atol=1e-6)


def test_packed_attention_needs_sdpa(make_model):
    model = make_model(attn_implementation="eager", pack_pairs=False)
    with pytest.raises(ValueError, match="needs attn_implementation 'sdpa'"):
        packing.enable_packed_attention(model)
    with pytest.raises(RuntimeError, match="not switched to packed attention"):
        packing.packed_last_hidden(model.base_model.model, {"input_ids": torch.ones(1, 3, dtype=torch.long)})


def test_memory_plan_counts_packed_tokens():
    """`activation_checkpointing: auto` sizes a packed micro-batch by its real tokens, not rows × longest row."""
    from lychee_pipeline.training import memory

    lengths = [900, 850, 600, 700, 880, 500]
    assert memory.longest_micro_batch_tokens(lengths, 4) == 4 * 900
    assert memory.longest_micro_batch_tokens(lengths, 4, packed=True) == 900 + 880 + 850 + 700
    padded = memory.choose_checkpoint_layers(8 * 1400, 3584, 28, 16 * 2**30, 40.0)
    packed = memory.choose_checkpoint_layers(8 * 1200, 3584, 28, 16 * 2**30, 40.0)
    assert packed.layers < padded.layers  # fewer tokens: fewer layers need checkpointing


@pytest.mark.parametrize("images", [True, False], ids=["images", "text_only"])
def test_a_host_prepared_forward_reads_nothing_back_from_the_device(family_model, tmp_path, images):
    """Scoring prepares each batch on the host (``host_inputs``: packed ids, mRoPE positions, the vision tower's
    grid-derived inputs). The forward on that batch must then never read a device tensor's values (each such
    read is a wait for the device): run on the ``meta`` device, where tensors have shapes but no values, it
    completes; the padded batch, packed inside the forward, cannot (it reads its token ids back). Copies from the
    host that wait for the device are not visible here: on a GPU, ``benchmarks/forward_syncs.py`` lists every
    synchronising call of a forward (0 on the H200, docs/benchmarks.md)."""
    model = family_model(finetune="frozen")
    model.eval()
    batch = GroupCollator(model.processor, group_size=4)(_rows(tmp_path, images=images))
    with torch.no_grad():
        expected = model(**batch)
        prepared = model.host_inputs(batch)
        torch.testing.assert_close(model(**prepared), expected, rtol=0, atol=0)  # the same forward on the CPU
        model.to("meta")
        meta_batch = {k: v.to("meta") if isinstance(v, (torch.Tensor, packing.PackedBatch)) else v
                      for k, v in prepared.items()}
        assert model(**meta_batch).shape == expected.shape
        with pytest.raises(NotImplementedError, match="no data"):
            model(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _model_batch(batch).items()})


def test_host_pixels_travel_in_the_vision_towers_dtype_with_the_same_scores(make_model, tmp_path):
    """A bf16 model: the host batch's pixels are cast to bf16 where they are prepared (half the bytes to copy to
    the device); the tower casts them first thing anyway, so the logits equal those from float32 pixels."""
    model = make_model(finetune="frozen", dtype="bf16")
    model.eval()
    batch = GroupCollator(model.processor, group_size=4)(_rows(tmp_path))
    assert batch["pixel_values"].dtype == torch.float32
    with torch.no_grad():
        prepared = model.host_inputs(batch)["packed"]
        assert prepared.pixel_values.dtype == torch.bfloat16
        with_float_pixels = dataclasses.replace(prepared, pixel_values=batch["pixel_values"])
        torch.testing.assert_close(model(packed=prepared), model(packed=with_float_pixels), rtol=0, atol=0)
