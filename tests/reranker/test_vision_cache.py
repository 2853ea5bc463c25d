"""The scorer's vision feature cache (reranker/vision_cache.py): an image seen before takes its features from the
cache instead of the vision tower, with the uncached scores; fp32 on the CPU, the tiny model of each family
(Qwen3-VL's DeepStack features are cached too)."""

from __future__ import annotations

import shutil

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker import packing
from lychee_pipeline.reranker.inference import Reranker
from lychee_pipeline.reranker.vision_cache import (
    AUTO_CPU_BYTES,
    GIB,
    ImageFeatures,
    VisionFeatureCache,
    cache_bytes,
    image_keys,
)

@pytest.fixture
def frozen_model(family_model):
    return family_model(finetune="frozen").eval()


def _image(path, w, h, seed):
    gen = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()).save(path)
    return str(path)


def _pairs(tmp_path, queries=4, images=3):
    """Every query lists the same few document images (the repeats a test set or a rerank file has), one query has
    an image of its own, and one document per query is text-only."""
    paths = [_image(tmp_path / f"doc_{i}.png", 84 + 28 * i, 112, i) for i in range(images)]
    query_image = _image(tmp_path / "query.png", 112, 84, 99)
    pairs = []
    for q in range(queries):
        query = {"text": f"query {q}: red running shoes", "image": query_image if q == 1 else None}
        pairs += [(query, {"text": f"document {d} " * (1 + d), "image": paths[(q + d) % images]})
                  for d in range(images)]
        pairs.append((query, {"text": "a document without an image", "image": None}))
    return pairs


class TowerCalls:
    """The images the vision tower runs on, by key (counted at the tower's forward)."""

    def __init__(self, model):
        self.patches = 0
        self.calls = 0
        self.handle = model.base_model.model.visual.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        self.calls += 1
        self.patches += int((args[0] if args else kwargs["hidden_states"]).shape[0])


def test_cached_scores_equal_the_uncached_and_each_image_runs_once(frozen_model, tmp_path):
    pairs = _pairs(tmp_path)
    plain = Reranker(frozen_model, batch_size=5, vision_cache_gib=0)
    assert plain.vision_cache is None
    expected = plain.score_pairs(pairs)

    scorer = Reranker(frozen_model, batch_size=5)  # auto: on
    tower = TowerCalls(frozen_model)
    first = scorer.score_pairs(pairs)
    torch.testing.assert_close(torch.tensor(first), torch.tensor(expected), rtol=0, atol=1e-5)
    stats = scorer.vision_cache.stats()
    # 4 queries x 3 document images + 1 query image: 13 image slots, 4 distinct images
    assert stats["images"] == 4 * 3 + 4 and stats["through_tower"] == 4 and len(scorer.vision_cache) == 4
    after_first = tower.patches

    second = scorer.score_pairs(pairs)  # everything known: the tower does not run
    assert second == first
    assert tower.patches == after_first
    assert scorer.vision_cache.stats()["through_tower"] == 4
    tower.handle.remove()


def test_prefix_reuse_with_the_cache_gives_the_plain_scores(frozen_model, tmp_path):
    pairs = _pairs(tmp_path)
    expected = Reranker(frozen_model, batch_size=8, vision_cache_gib=0).score_pairs(pairs)
    scorer = Reranker(frozen_model, batch_size=8, prefix_reuse=True)
    for _ in range(2):
        torch.testing.assert_close(torch.tensor(scorer.score_pairs(pairs)), torch.tensor(expected), rtol=0,
                                   atol=1e-5)


def test_a_small_cache_evicts_the_least_recently_used(make_model, tmp_path):
    model = make_model(finetune="frozen").eval()
    pairs = _pairs(tmp_path, queries=3, images=3)
    expected = Reranker(model, batch_size=4, vision_cache_gib=0).score_pairs(pairs)
    probe = Reranker(model, batch_size=4)
    probe.score_pairs(pairs)
    sizes = [f.nbytes for f in probe.vision_cache._entries.values()]
    biggest = max(sizes)
    assert len(sizes) == 4 and sum(sizes) > 2 * biggest
    scorer = Reranker(model, batch_size=4, vision_cache_gib=(2 * biggest + 0.5) / GIB)  # room for two images
    assert scorer.vision_cache.max_bytes == 2 * biggest
    torch.testing.assert_close(torch.tensor(scorer.score_pairs(pairs)), torch.tensor(expected), rtol=0, atol=1e-5)
    cache = scorer.vision_cache
    assert 0 < cache.bytes <= cache.max_bytes and len(cache) < 4
    assert cache.stats()["through_tower"] > 4  # 4 distinct images: some ran again after they were evicted
    assert Reranker(model, vision_cache_gib=1e-9).vision_cache.max_bytes == 1  # smaller than any image: none kept


def test_changed_tower_weights_empty_the_cache(make_model, tmp_path):
    model = make_model(finetune="frozen").eval()
    pairs = _pairs(tmp_path, queries=2)
    scorer = Reranker(model, batch_size=8)
    before = scorer.score_pairs(pairs)
    assert len(scorer.vision_cache) > 0
    with torch.no_grad():  # a training step on the tower, in place (an optimizer's update)
        next(model.base_model.model.visual.parameters()).mul_(1.5)
    expected = Reranker(model, batch_size=8, vision_cache_gib=0).score_pairs(pairs)
    assert expected != before
    torch.testing.assert_close(torch.tensor(scorer.score_pairs(pairs)), torch.tensor(expected), rtol=0, atol=1e-5)


def test_keys_follow_the_pixels_not_the_path(make_model, tmp_path):
    model = make_model(finetune="frozen").eval()
    first = _image(tmp_path / "a.png", 112, 112, 1)
    copy = shutil.copy(first, tmp_path / "copy_of_a.png")
    other = _image(tmp_path / "b.png", 112, 112, 2)
    query = {"text": "red shoes", "image": None}
    scorer = Reranker(model, batch_size=8)
    scorer.score_pairs([(query, {"text": "x", "image": p}) for p in (first, copy, other)])
    assert len(scorer.vision_cache) == 2  # the copy is the same image

    pixels = torch.rand(8, 12)
    grid = torch.tensor([[1, 2, 2], [1, 2, 2]])
    same = torch.cat([pixels[:4], pixels[:4]])
    assert image_keys(same, grid)[0] == image_keys(same, grid)[1]
    assert image_keys(pixels, grid)[0] != image_keys(pixels, grid)[1]
    assert image_keys(same, grid)[0] != image_keys(same.bfloat16(), grid)[0]  # what the tower sees differs
    assert image_keys(pixels[:4], torch.tensor([[1, 2, 2]]))[0] != image_keys(pixels[:4], torch.tensor([[1, 1, 4]]))[0]


def test_cache_size_setting():
    assert cache_bytes("auto", "cpu") == AUTO_CPU_BYTES
    assert cache_bytes(" AUTO ", "cpu") == AUTO_CPU_BYTES
    assert cache_bytes(0, "cpu") == 0 and cache_bytes(None, "cpu") == 0
    assert cache_bytes(1.5, "cpu") == int(1.5 * GIB) and cache_bytes("2", "cpu") == 2 * GIB
    for bad in (-1, "lots", float("nan")):
        with pytest.raises(ValueError, match="vision_cache_gib must be 'auto' or a number of GiB >= 0"):
            cache_bytes(bad, "cpu")


def test_cache_bookkeeping():
    cache = VisionFeatureCache(3 * 4 * 4)  # three 4-float images
    features = {k: ImageFeatures(torch.full((1, 4), float(i))) for i, k in enumerate((b"a", b"b", b"c", b"d"))}
    for key in (b"a", b"b", b"c"):
        cache.put(key, features[key])
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"d", features[b"d"])
    assert b"b" not in cache and all(k in cache for k in (b"a", b"c", b"d")) and cache.bytes == 48
    kept = cache.get(b"d")
    features[b"d"].embeds.fill_(7)  # a copy is kept, not the caller's tensor
    assert float(kept.embeds[0, 0]) == 3.0
    cache.put(b"big", ImageFeatures(torch.zeros(4, 4)))  # larger than the whole cache: not kept
    assert b"big" not in cache and len(cache) == 3
    cache.discard(b"a")
    assert b"a" not in cache and cache.bytes == 32


def test_a_padded_model_scores_without_a_cache(make_model, tmp_path):
    model = make_model(finetune="frozen", pack_pairs=False).eval()
    scorer = Reranker(model, batch_size=8)
    assert scorer.vision_cache is None and not scorer.preparation.keyed_images
    assert len(scorer.score_pairs(_pairs(tmp_path, queries=1))) == 4


def test_a_partly_cached_forward_reads_nothing_back_from_the_device(frozen_model, tmp_path):
    """Half of a batch's images in the cache: the tower runs on the other half's pixel rows, with their grid-derived
    inputs worked out on the host. On the ``meta`` device (shapes, no values) the forward completes, so it reads
    no device value back (the CPU run first checks the scores)."""
    pairs = _pairs(tmp_path, queries=2, images=4)
    scorer = Reranker(frozen_model, batch_size=len(pairs))
    (_, batch), = list(scorer.batches(pairs))
    packed_batch = batch["packed"]
    keys = list(dict.fromkeys(packed_batch.image_keys))
    assert len(keys) == 5
    with torch.no_grad():
        expected = frozen_model(**batch)
        cache = VisionFeatureCache(GIB)
        frozen_model(**batch, vision_cache=cache)
        for key in keys[::2]:
            cache.discard(key)
        tower = TowerCalls(frozen_model)
        torch.testing.assert_close(frozen_model(**batch, vision_cache=cache), expected, rtol=0, atol=1e-5)
        assert tower.calls == 1 and len(cache) == 5
        tower.handle.remove()

        frozen_model.to("meta")
        meta_cache = VisionFeatureCache(GIB)
        meta_cache.follow(frozen_model.base_model.model.visual)  # the meta weights: the entries below are theirs
        for key in keys[1::2]:
            features = cache.get(key)
            meta_cache.put(key, ImageFeatures(features.embeds.to("meta"), tuple(t.to("meta") for t in features.deepstack)))
        meta_batch = {k: v.to("meta") if isinstance(v, (torch.Tensor, packing.PackedBatch)) else v
                      for k, v in batch.items()}
        assert frozen_model(**meta_batch, vision_cache=meta_cache).shape == expected.shape
        assert meta_cache.stats()["through_tower"] == 3
