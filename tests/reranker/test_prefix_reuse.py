"""Prefix reuse in packed scoring (reranker/prefix.py): a query's shared prompt prefix runs once per batch and
each candidate attends to it; the scores equal the plain packed path's (fp32, the built-in tiny Qwen2.5-VL) for
text-only pairs, image queries and image documents, in batches of several sizes, while fewer tokens run."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker import packing, prefix
from lychee_pipeline.reranker.collate import PairCollator
from lychee_pipeline.reranker.inference import Reranker


def _image(path, w, h, seed):
    gen = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()).save(path)
    return str(path)


def _pairs(tmp_path, query_images: bool, doc_images: bool, queries: int = 3, docs: int = 5):
    """Each query's candidates, the queries interleaved (the scorer has to bring a query's pairs together)."""
    sizes = [(112, 112), (168, 84), (84, 140)]
    out = []
    for d in range(docs):
        for q in range(queries):
            query_image = _image(tmp_path / f"q{q}.png", 140, 112, 50 + q) if query_images and q != 1 else None
            doc_image = (_image(tmp_path / f"d{q}_{d}.png", *sizes[(q + d) % 3], 10 * q + d)
                         if doc_images and d % 2 == 0 else None)
            query = {"text": f"query {q}: blue running shoes for trail", "image": query_image}
            out.append((query, {"text": f"document {d} about shoes " * (1 + d), "image": doc_image}))
    return out


class TokenCount:
    """Tokens the language model ran on, summed over forwards (from the packed batches it was given)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.tokens += kwargs["packed"].tokens


@pytest.mark.parametrize("query_images,doc_images", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["text_only", "image_queries", "image_documents", "both"])
@pytest.mark.parametrize("batch_size", [4, 7, 15])
def test_prefix_reuse_scores_equal_the_plain_path_with_fewer_tokens(make_model, tmp_path, query_images, doc_images,
                                                                    batch_size):
    model = make_model(finetune="frozen")
    model.eval()
    pairs = _pairs(tmp_path, query_images, doc_images)
    counts = {}
    scores = {}
    for reuse in (False, True):
        counter = TokenCount(model)
        scorer = Reranker(model, batch_size=batch_size, max_pixels=64 * 28 * 28, prefix_reuse=reuse)
        scores[reuse] = scorer.score_pairs(pairs)
        counter.handle.remove()
        counts[reuse] = counter.tokens
    torch.testing.assert_close(torch.tensor(scores[True]), torch.tensor(scores[False]), rtol=0, atol=1e-5)
    assert counts[True] < counts[False], counts


def test_shared_prefix_layout_keeps_positions_and_query_image_once(make_model, tmp_path):
    """One batch of one image query's candidates: the query image's tokens and pixels appear once, the prefix
    is one segment, every suffix attends to it, and each suffix's mRoPE positions are the unshared pair's."""
    model = make_model(finetune="frozen")
    model.eval()
    # one instruction for all (without one, it follows each pair's modalities: image and text documents differ)
    pairs = [(query, doc, "Find the matching product") for query, doc in _pairs(tmp_path, True, True, 1, 4)]
    collator = PairCollator(model.processor, max_pixels=64 * 28 * 28)
    batch = collator.encode([collator.prepare(p) for p in pairs])
    vl = model.base_model.model
    plain = packing.pack_batch(vl, dict(batch))
    shared = packing.pack_batch(vl, dict(batch), share_prefixes=True)
    assert shared.pairs == plain.pairs == 4
    assert len(shared.plan.starts) == 5 and shared.plan.prefixes[0] is None
    assert all(p == (0, shared.plan.ends[0]) for p in shared.plan.prefixes[1:])
    saved = plain.tokens - shared.tokens
    assert saved == 3 * shared.plan.ends[0]
    assert shared.image_grid_thw.shape[0] == plain.image_grid_thw.shape[0] - 3  # the query image once, not 4 times
    for pair in range(4):  # the last token of each pair sits at the same 3-D position in both layouts
        torch.testing.assert_close(shared.position_ids[:, 0, shared.last_index[pair]],
                                   plain.position_ids[:, 0, plain.last_index[pair]], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(packed=shared), model(packed=plain), rtol=0, atol=1e-5)


def test_same_tokens_different_query_image_share_no_image(make_model, tmp_path):
    """Two queries with the same text and same-sized but different images have the same token ids: the prefix
    stops before the image, whose pixels differ."""
    model = make_model(finetune="frozen")
    model.eval()
    doc = {"text": "a document", "image": None}
    pairs = [({"text": "same", "image": _image(tmp_path / f"s{i}.png", 112, 112, i)}, doc) for i in range(2)]
    collator = PairCollator(model.processor, max_pixels=64 * 28 * 28)
    batch = collator.encode([collator.prepare(p) for p in pairs])
    shared = packing.pack_batch(model.base_model.model, dict(batch), share_prefixes=True)
    plain = packing.pack_batch(model.base_model.model, dict(batch))
    assert shared.image_grid_thw.shape[0] == 2
    first_image_token = int((plain.input_ids[0] == model.base_model.config.image_token_id).nonzero()[0])
    assert shared.plan.ends[0] <= first_image_token
    with torch.no_grad():
        torch.testing.assert_close(model(packed=shared), model(packed=plain), rtol=0, atol=1e-5)


def test_suffix_mask_sees_the_prefix_and_its_own_past():
    mask = prefix.suffix_mask(3, 2, torch.device("cpu"))[0, 0]
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                             [True, True, True, True, True]]
    rows, bounds, longest = prefix.key_gather((0, 4, 7), (4, 7, 9), (None, (0, 4), (0, 4)))
    assert rows.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 7, 8]
    assert bounds.tolist() == [0, 4, 11, 17] and longest == 7


def test_prefix_reuse_is_refused_without_packed_pairs(make_model):
    model = make_model(finetune="frozen", pack_pairs=False)
    with pytest.raises(ValueError, match=r"^prefix_reuse needs packed pairs \(model.pack_pairs: true\)"):
        Reranker(model, prefix_reuse=True)


def test_prefix_reuse_is_refused_where_the_family_refuses_it(make_model, monkeypatch):
    from lychee_pipeline.reranker.families import qwen2_5_vl

    model = make_model(finetune="frozen")
    monkeypatch.setitem(qwen2_5_vl.REFUSED_FAST_PATHS, "prefix_reuse", "its visual features reach later layers")
    with pytest.raises(ValueError, match=r"^prefix_reuse: the qwen2_5_vl family does not support it: its visual "
                                         r"features reach later layers; set prefix_reuse: false$"):
        Reranker(model, prefix_reuse=True)


def test_from_pretrained_takes_prefix_reuse(tiny_dir):
    scorer = Reranker.from_pretrained("builtin:tiny", device="cpu", tiny_cache_dir=tiny_dir, prefix_reuse=True)
    assert scorer.prefix_reuse and scorer.preparation.prefix_reuse
    assert not Reranker.from_pretrained("builtin:tiny", device="cpu", tiny_cache_dir=tiny_dir).prefix_reuse  # auto


def test_prefix_reuse_auto_is_on_only_where_attention_is_one_varlen_call(monkeypatch):
    """``prefix_reuse: auto`` (the default): on where the packed batch's attention is one variable-length flash call
    per layer (a CUDA GPU, whose readiness check is stood in for here: this machine has none), off on a CPU, for a
    padded model or a family that refuses it; anything but auto / true / false is a one-line error."""
    cpu, gpu, bf16 = torch.device("cpu"), torch.device("cuda", 0), torch.bfloat16
    resolve = prefix.resolve_prefix_reuse
    padded = "prefix_reuse needs packed pairs (model.pack_pairs: true); set prefix_reuse: false"
    assert resolve("auto", None, cpu, bf16) is False  # the real check on this machine
    assert resolve(True, None, cpu, torch.float32) is True and resolve(False, None, gpu, bf16) is False
    monkeypatch.setattr(packing, "varlen_attention_ready", lambda device: torch.device(device).type == "cuda")
    assert resolve("auto", None, gpu, bf16) is True
    assert resolve("auto", None, gpu, torch.float32) is False  # fp32: one masked SDPA call per segment
    assert resolve("auto", padded, gpu, bf16) is False  # padded pairs
    assert resolve("auto", "no shared prefix in this family", gpu, bf16) is False
    with pytest.raises(ValueError, match=r"^prefix_reuse needs packed pairs \(model.pack_pairs: true\); set "
                                         r"prefix_reuse: false$"):
        resolve(True, padded, gpu, bf16)  # asked for where it cannot run: the model's refusal, in one line
    with pytest.raises(ValueError, match=r"^prefix_reuse must be auto, true or false, got 'yes'$"):
        resolve("yes", None, gpu, bf16)


def test_the_variable_length_kernels_inputs_give_the_masked_attention(make_model, tmp_path):
    """What the CUDA path hands the variable-length flash kernel (queries: the packed sequence cut by the plan;
    keys: the rows ``key_rows`` gathers, cut by ``cu_seqlens_k``; causal aligned to the bottom right, flash's
    convention) computes, segment by segment, what the CPU path's masked SDPA computes."""
    from torch import nn
    from torch.nn.attention.bias import causal_lower_right

    model = make_model(finetune="frozen")
    pairs = _pairs(tmp_path, True, True, queries=2, docs=3)
    collator = PairCollator(model.processor, max_pixels=64 * 28 * 28)
    packed = packing.pack_batch(model.base_model.model, collator.encode([collator.prepare(p) for p in pairs]),
                                share_prefixes=True)
    assert any(p is not None for p in packed.plan.prefixes)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, packed.tokens, 8, generator=gen) for _ in range(3))
    module = nn.Module()
    module.is_causal = True
    masked, _ = packing.packed_attention_forward(module, q, k, v, None,
                                                 **{packing.PLAN_KWARG: packed.attention_bounds()})
    bounds_q, bounds_k = packed.cu_seqlens.tolist(), packed.cu_seqlens_k.tolist()
    assert packed.longest_key == max(b - a for a, b in zip(bounds_k[:-1], bounds_k[1:]))
    for i in range(len(bounds_q) - 1):
        rows = packed.key_rows[bounds_k[i] : bounds_k[i + 1]]
        seg_q = q[:, :, bounds_q[i] : bounds_q[i + 1]]
        seg_k, seg_v = k[:, :, rows], v[:, :, rows]
        bias = causal_lower_right(seg_q.shape[2], seg_k.shape[2])
        expected = torch.nn.functional.scaled_dot_product_attention(seg_q, seg_k, seg_v, attn_mask=bias)
        torch.testing.assert_close(masked[0, bounds_q[i] : bounds_q[i + 1]], expected[0].transpose(0, 1),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("query_images,doc_images", [(True, True), (False, False)], ids=["both", "text_only"])
def test_prefix_reuse_on_the_qwen3_vl_family_keeps_its_scores(tmp_path, query_images, doc_images):
    """Qwen3-VL's DeepStack features follow the kept images when prefixes are shared: the same scores as its plain
    packed path (fp32, builtin:tiny-qwen3-vl), fewer tokens."""
    from lychee_pipeline.reranker.model import ModelConfig, load_reranker
    from lychee_pipeline.reranker.tiny import ensure_tiny

    name = "builtin:tiny-qwen3-vl"
    folder = str(ensure_tiny(tmp_path / "qwen3", name))
    model = load_reranker(ModelConfig(name_or_path=name, tiny_cache_dir=folder, finetune="frozen"), device="cpu")
    assert model.config.pack_pairs is True  # pack_pairs auto packs this family too
    model.eval()
    pairs = _pairs(tmp_path, query_images, doc_images)
    counts, scores = {}, {}
    for reuse in (False, True):
        counter = TokenCount(model)
        scores[reuse] = Reranker(model, batch_size=7, max_pixels=64 * 32 * 32, prefix_reuse=reuse).score_pairs(pairs)
        counter.handle.remove()
        counts[reuse] = counter.tokens
    torch.testing.assert_close(torch.tensor(scores[True]), torch.tensor(scores[False]), rtol=0, atol=1e-5)
    assert counts[True] < counts[False], counts
