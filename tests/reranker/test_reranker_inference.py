"""Inference: p(yes) scores, batching invariance, input order, adapter / merged / full round trips."""

import json

import pytest
import torch

from lychee_pipeline.reranker import Reranker


def _docs(images):
    return [
        {"text": "red running shoes for women with a mesh upper", "image": None},
        {"text": None, "image": images["red"]},
        {"text": "a blue bag", "image": images["blue"]},
        {"text": "x", "image": None},
        {"text": "green " * 30, "image": images["wide"]},
        {"text": None, "image": images["green"]},
    ]


def _perturb(model, scale=0.2, seed=0):
    """Give the freshly initialised LoRA weights non-zero values so the adapter changes the scores."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def reranker(tiny_dir):
    return Reranker.from_pretrained("builtin:tiny", device="cpu", batch_size=4, tiny_cache_dir=tiny_dir)


def test_scores_are_probabilities_for_mixed_docs(reranker, images):
    query = {"text": "red shoes", "image": None}
    scores = reranker.score(query, _docs(images))
    assert len(scores) == 6
    assert all(isinstance(s, float) and 0.0 < s < 1.0 for s in scores)
    assert len(set(scores)) == 6


def test_a_pair_alone_equals_its_score_in_a_padded_mixed_batch(reranker, images):
    query = {"text": "red shoes", "image": images["blue"]}
    docs = _docs(images)
    in_batch = Reranker(reranker.model, batch_size=len(docs)).score(query, docs)
    alone = [reranker.score(query, [d])[0] for d in docs]
    assert max(abs(a - b) for a, b in zip(in_batch, alone)) < 1e-4


def test_input_order_is_kept_and_rerank_sorts(reranker, images):
    query = {"text": "red shoes", "image": None}
    docs = _docs(images)
    scores = reranker.score(query, docs)
    reversed_scores = reranker.score(query, docs[::-1])
    assert reversed_scores[::-1] == pytest.approx(scores, abs=1e-5)
    ranked = reranker.rerank(query, docs, top_k=3)
    assert len(ranked) == 3
    best = sorted(range(len(docs)), key=lambda i: -scores[i])[:3]
    assert [i for i, _ in ranked] == best
    assert [s for _, s in ranked] == pytest.approx([scores[i] for i in best], abs=1e-5)
    pairs = [(query, d) for d in docs] + [({"text": None, "image": images["red"]}, docs[0])]
    assert reranker.score_pairs(pairs)[:6] == pytest.approx(scores, abs=1e-5)


def test_adapter_save_load_and_merge_give_the_adapters_scores(make_model, tiny_dir, images, tmp_path):
    model = make_model(finetune="lora")
    _perturb(model)
    query = {"text": "blue bag", "image": None}
    docs = _docs(images)
    base = Reranker.from_pretrained("builtin:tiny", device="cpu", tiny_cache_dir=tiny_dir).score(query, docs)
    live = Reranker(model).score(query, docs)
    assert max(abs(a - b) for a, b in zip(live, base)) > 1e-3  # the adapter matters

    adapter_dir = model.save_pretrained(tmp_path / "adapter")
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    assert not list(adapter_dir.glob("*.bin")) and not (adapter_dir / "model.safetensors").exists()
    assert json.loads((adapter_dir / "lychee_reranker.json").read_text())["format"] == "adapter"
    loaded = Reranker.from_pretrained("builtin:tiny", adapter=str(adapter_dir), device="cpu", tiny_cache_dir=tiny_dir)
    assert loaded.score(query, docs) == live
    # the adapter folder alone is enough: the base model comes from its metadata
    assert Reranker.from_pretrained(str(adapter_dir), device="cpu", tiny_cache_dir=tiny_dir).score(query, docs) == live

    merged_dir = model.merge_and_save(tmp_path / "merged")
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "adapter_config.json").exists()
    merged = Reranker.from_pretrained(str(merged_dir), device="cpu")
    assert not merged.model.is_peft
    assert max(abs(a - b) for a, b in zip(merged.score(query, docs), live)) < 1e-5
    assert Reranker(model).score(query, docs) == live  # merging left the training model untouched


def test_full_finetune_save_and_load(make_model, images, tmp_path):
    model = make_model(finetune="full")
    with torch.no_grad():
        model.base_model.lm_head.weight[model.yes_id] += 0.5
    query = {"text": "q", "image": None}
    docs = _docs(images)[:3]
    live = Reranker(model).score(query, docs)
    out = model.save_pretrained(tmp_path / "full")
    assert (out / "model.safetensors").is_file()
    assert Reranker.from_pretrained(str(out), device="cpu").score(query, docs) == pytest.approx(live, abs=1e-6)
