"""Collators: left padding, all processor outputs, text-only truncation, broken images, groups."""

import pytest
import torch

from lychee_pipeline.reranker import GroupCollator, PairCollator, max_pixels_at, sample_group
from lychee_pipeline.reranker.collate import BrokenImageError
from lychee_pipeline.reranker.families.qwen2_5_vl import load_processor


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return load_processor(tiny_dir)


def _row(images, n_hard=6, n_easy=6, record_id="rec-1"):
    negatives = [
        {"doc_id": f"h{i}", "text": f"hard negative {i}", "image": None, "hard": True, "meta": "{}"}
        for i in range(n_hard)
    ] + [
        {"doc_id": f"e{i}", "text": f"random negative {i}", "image": images["green"] if i % 2 else None,
         "hard": False, "meta": "{}"}
        for i in range(n_easy)
    ]
    return {
        "record_id": record_id,
        "query": {"text": "red shoes", "image": None},
        "positives": [{"doc_id": "p0", "text": "red running shoes", "image": images["red"], "meta": "{}"}],
        "negatives": negatives,
        "task_type": "t2it",
        "language": "en",
        "split": "train",
    }


def test_left_padding_and_every_output_passed(processor, images):
    pairs = [
        ({"text": "q", "image": None}, {"text": "short", "image": None}),
        ({"text": "q", "image": images["blue"]}, {"text": "a much longer document " * 5, "image": images["red"]}),
    ]
    batch = PairCollator(processor)(pairs)
    assert {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(batch)
    mask = batch["attention_mask"]
    assert bool(mask[:, -1].all()) and not bool(mask[0, 0])  # pad on the left
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["mm_token_type_ids"] != 0).sum()) == int((batch["input_ids"] == image_id).sum())
    assert batch["image_grid_thw"].shape == (2, 3)


def test_truncation_cuts_text_never_image_tokens(processor, images):
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    query = {"text": "find this " * 20, "image": images["blue"]}
    doc = {"text": "long description words " * 60, "image": images["wide"]}
    untruncated = PairCollator(processor, max_length=100_000)([(query, doc)])
    n_image_tokens = int((untruncated["input_ids"] == image_id).sum())
    full_len = untruncated["input_ids"].shape[1]
    budget = n_image_tokens + 300
    collator = PairCollator(processor, max_length=budget)
    batch = collator([(query, doc), ({"text": "short", "image": None}, {"text": "short doc", "image": None})])
    assert batch["input_ids"].shape[1] <= budget
    assert int((batch["input_ids"][0] == image_id).sum()) == n_image_tokens
    torch.testing.assert_close(batch["pixel_values"][: untruncated["pixel_values"].shape[0]], untruncated["pixel_values"])
    stats = collator.stats
    assert stats.pairs == 2 and stats.truncated_pairs == 1
    assert stats.truncated_tokens == full_len - int(batch["attention_mask"][0].sum())
    assert stats.over_length_pairs == 0
    # the document text is cut first: the query text is still whole
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert "find this " * 20 in text
    assert "long description words" in text and "long description words " * 60 not in text


def test_images_larger_than_the_budget_are_kept_whole_and_counted(processor, images):
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    collator = PairCollator(processor, max_length=20)
    batch = collator([({"text": "q", "image": images["blue"]}, {"text": "some text here", "image": images["blue"]})])
    assert int((batch["input_ids"] == image_id).sum()) == 2 * 16  # 112x112 -> 4x4 merged tokens each
    assert collator.stats.over_length_pairs == 1


def test_pixel_budget_and_schedule(processor, images):
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pair = ({"text": "q", "image": None}, {"text": None, "image": images["blue"]})
    collator = PairCollator(processor, min_pixels=28 * 28, max_pixels=112 * 112)
    assert int((collator([pair])["input_ids"] == image_id).sum()) == 16
    collator.set_max_pixels(56 * 56)
    assert int((collator([pair])["input_ids"] == image_id).sum()) == 4
    schedule = [(0.0, 56 * 56), (0.5, 112 * 112)]
    assert [max_pixels_at(p, schedule) for p in (0.0, 0.49, 0.5, 1.0)] == [3136, 3136, 12544, 12544]
    assert max_pixels_at(0.1, {0.2: 100, 0.6: 200}, default=50) == 50
    assert max_pixels_at(0.7, 999) == 999
    assert max_pixels_at(0.3, None, default=777) == max_pixels_at(0.3, [], default=777) == 777


def test_broken_and_missing_images_name_the_file(processor, images, tmp_path):
    collator = PairCollator(processor)
    with pytest.raises(BrokenImageError, match="broken.png") as info:
        collator([({"text": "q", "image": None}, {"text": "d", "image": images["broken"]})])
    assert info.value.path == images["broken"]
    missing = str(tmp_path / "gone.jpg")
    with pytest.raises(BrokenImageError, match="gone.jpg"):
        collator([({"text": None, "image": missing}, {"text": "d", "image": None})])


def test_sample_group_hard_first_half_and_redrawn_by_epoch(images):
    row = _row(images)
    g = sample_group(row, group_size=8, epoch=0, seed=7)
    assert g["docs"][0]["text"] == "red running shoes"
    negs = [d["text"] for d in g["docs"][1:]]
    assert len(negs) == 7 and len(set(negs)) == 7
    assert sum(t.startswith("hard") for t in negs) == 4  # ceil(7 / 2) mined ones first
    assert all(t.startswith("hard") for t in negs[:4]) and all(t.startswith("random") for t in negs[4:])
    assert sample_group(row, 8, epoch=0, seed=7) == g  # deterministic
    draws = {tuple(d["text"] for d in sample_group(row, 8, epoch=e, seed=7)["docs"]) for e in range(6)}
    assert len(draws) > 1  # re-drawn each epoch


def test_sample_group_fills_in_and_errors_when_short(images):
    few_easy = sample_group(_row(images, n_hard=6, n_easy=1), group_size=6)
    assert sum(d["text"].startswith("hard") for d in few_easy["docs"][1:]) == 4
    only_easy = sample_group(_row(images, n_hard=0, n_easy=5), group_size=4)
    assert all(d["text"].startswith("random") for d in only_easy["docs"][1:])
    with pytest.raises(ValueError, match="rec-1 has 3 negatives"):
        sample_group(_row(images, n_hard=2, n_easy=1), group_size=8)


def test_group_collator_labels_and_instruction_per_row(processor, images):
    collator = GroupCollator(processor, group_size=4, instructions={"t2it": "Pick the product"}, seed=3)
    batch = collator([_row(images, record_id="a"), _row(images, record_id="b")])
    assert batch["input_ids"].shape[0] == 8 and batch["group_size"] == 4
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
    texts = processor.tokenizer.batch_decode(batch["input_ids"])
    assert all("<Instruct>: Pick the product<Query>:" in t for t in texts)
    assert "red running shoes<|im_end|>" in texts[0] and "red running shoes<|im_end|>" in texts[4]
    collator.set_epoch(1)
    assert collator.epoch == 1


def test_query_text_is_cut_once_the_document_text_is_gone(processor, images):
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    query = {"text": "query words " * 80, "image": images["red"]}
    doc = {"text": "document words " * 80, "image": images["blue"]}
    base = PairCollator(processor, max_length=100_000)([({"text": None, "image": images["red"]},
                                                        {"text": None, "image": images["blue"]})])
    floor = base["input_ids"].shape[1]  # the prompt with both images and no text at all
    collator = PairCollator(processor, max_length=floor + 10)
    batch = collator([(query, doc)])
    assert batch["input_ids"].shape[1] <= floor + 10
    assert int((batch["input_ids"] == image_id).sum()) == 4 + 16
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert "document words" not in text and "query" in text
    assert collator.stats.truncated_pairs == 1 and collator.stats.over_length_pairs == 0


def test_rows_with_array_columns_from_pandas(processor, images):
    import numpy as np

    row = _row(images)
    row["positives"] = np.array(row["positives"], dtype=object)
    row["negatives"] = np.array(row["negatives"], dtype=object)
    group = sample_group(row, group_size=3, epoch=0, seed=0)
    assert len(group["docs"]) == 3 and group["docs"][0]["image"] == images["red"]


def _pool(images):
    """Other training records; one holds a document with the same content as rec-1's positive under another
    id (a false negative in disguise), one a document with rec-1's positive id."""
    rows = [_row(images, n_hard=2, n_easy=2, record_id=f"other-{k}") for k in range(4)]
    for k, row in enumerate(rows):
        row["positives"] = [{"doc_id": f"op{k}", "text": f"other positive {k}", "image": None, "meta": "{}"}]
        for i, neg in enumerate(row["negatives"]):
            neg["doc_id"], neg["text"] = f"o{k}n{i}", f"other negative {k}.{i}"
    rows[0]["negatives"][0].update(doc_id="copy-of-p0", text="red running shoes", image=images["red"])
    rows[1]["negatives"][1].update(doc_id="p0", text="same id as the positive", image=None)
    return rows


def test_short_group_is_filled_from_other_records_never_with_a_positive(images):
    short = _row(images, n_hard=1, n_easy=0)
    pool = [short] + _pool(images)
    seen = set()
    for epoch in range(30):
        group = sample_group(short, group_size=6, epoch=epoch, seed=5, fill_pool=pool)
        assert len(group["docs"]) == 6 and group["filled"] == 4
        assert group["hard"] == [True, False, False, False, False]  # its own mined negative, then 4 random ones
        assert group["doc_ids"][:2] == ["p0", "h0"]
        filled = group["docs"][2:]
        assert all(d["text"].startswith("other ") for d in filled), filled  # never the positive's content or id
        assert len({(d["text"], d["image"]) for d in group["docs"]}) == 6  # no document twice in a group
        seen.update(d["text"] for d in filled)
    assert len(seen) > 10  # drawn across the pool, re-drawn by epoch
    # a pure function of (seed, epoch, record): same draw in another call, another draw in another epoch
    assert sample_group(short, 6, epoch=3, seed=5, fill_pool=pool) == sample_group(short, 6, 3, 5, pool)
    assert sample_group(short, 6, 3, 5, pool)["docs"] != sample_group(short, 6, 4, 5, pool)["docs"]
    assert sample_group(short, 6, 3, 5, pool)["docs"] != sample_group(short, 6, 3, 6, pool)["docs"]
    # a record with enough negatives never draws from the pool, and draws as it did without one
    full = _row(images)
    assert sample_group(full, 8, 2, 7, fill_pool=pool) == sample_group(full, 8, 2, 7)


def test_fill_refuses_when_the_pool_cannot_fill_the_group(images):
    short = _row(images, n_hard=1, n_easy=0)
    with pytest.raises(ValueError, match="rec-1 has 1 negatives but group_size=6 needs 5"):
        sample_group(short, group_size=6)  # no pool: the refuse policy
    tiny_pool = [short, _pool(images)[2]]  # one other record: 5 documents for 4 slots... for 8 slots too few
    assert sample_group(short, 6, fill_pool=tiny_pool)["filled"] == 4
    with pytest.raises(ValueError, match="record rec-1: could not draw 8 random negatives from the other 1 training "
                                         "records"):
        sample_group(short, group_size=10, fill_pool=tiny_pool)


def test_group_collator_fill_policy_and_counts(processor, images):
    short = _row(images, n_hard=1, n_easy=0)
    rows = [short, _row(images, record_id="b")]
    pool = [short] + _pool(images)  # (b needs no filling)
    with pytest.raises(ValueError, match="rec-1 has 1 negatives but group_size=4 needs 3"):
        GroupCollator(processor, group_size=4, negative_fill="refuse", fill_pool=pool)(rows)
    with pytest.raises(ValueError, match="negative_fill='fill_random' needs fill_pool"):
        GroupCollator(processor, group_size=4, negative_fill="fill_random")
    with pytest.raises(ValueError, match="negative_fill must be one of"):
        GroupCollator(processor, group_size=4, negative_fill="random")
    collator = GroupCollator(processor, group_size=4, seed=3, negative_fill="fill_random", fill_pool=pool)
    batch = collator(rows)
    assert batch["input_ids"].shape[0] == 8 and batch["labels"].tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
    assert collator.fill_stats.as_dict() == {"groups": 2, "filled_groups": 1, "filled_slots": 2}
    texts = processor.tokenizer.batch_decode(batch["input_ids"][:4])
    assert sum("other " in t for t in texts) == 2 and "red running shoes<|im_end|>" in texts[0]
    # the group of a record does not depend on the rows it is batched with
    alone = GroupCollator(processor, group_size=4, seed=3, negative_fill="fill_random", fill_pool=pool)([short])
    assert torch.equal(alone["input_ids"][:, -40:], batch["input_ids"][:4, -40:])


def test_an_image_shared_by_a_batch_is_read_and_processed_once_with_the_same_inputs(family_model, images):
    """A query image in each of its candidates' prompts: ``decode_batch`` reads it once and shares it, and the
    processor patches it once (``EachImageOnce``); the batch is the same, tensor for tensor, as when every copy is
    read and processed on its own — for both families' processors."""
    from lychee_pipeline.reranker.collate import EachImageOnce

    model = family_model(finetune="frozen")
    collator = PairCollator(model.processor, max_pixels=12544, family=model.family.NAME)
    query = {"text": "a red thing", "image": images["red"]}
    pairs = [(query, {"text": "doc", "image": images[c]}) for c in ("blue", "wide", "red", "green")]
    prepared = [collator.prepare(p, decode=False) for p in pairs]
    shared = collator.decode_batch(prepared)
    assert all(s[1][0] is shared[0][1][0] for s in shared) and shared[2][1][1] is shared[0][1][0]
    separate = [collator.decode(p) for p in prepared]
    assert len({id(im) for p in separate for im in p[1]}) == 8
    image_processor = model.processor.image_processor
    once, each = collator.encode(shared), collator.encode(separate)
    assert model.processor.image_processor is image_processor  # only swapped inside the call
    assert once.keys() == each.keys()
    for key in each:
        assert torch.equal(once[key], each[key]), key
    # what the image processor was given: the 4 distinct images, in order of first appearance
    flat = [im for p in shared for im in p[1]]
    plan = EachImageOnce(model.processor, flat)
    assert plan.order == [0, 1, 0, 2, 0, 0, 0, 3] and len(plan.distinct) == 4
    import copy

    with plan:  # the processor can be copied while it holds the stand-in (a preparing thread's own processor)
        assert copy.deepcopy(model.processor).image_processor.merge_size == image_processor.merge_size
    assert model.processor.image_processor is image_processor


def test_a_training_group_reads_its_query_image_once_with_the_same_batch(processor, images, monkeypatch):
    """``GroupCollator`` (through ``PairCollator.__call__``) reads a group's query image once for its documents'
    prompts; the batch and the truncation counts are those of preparing and reading every pair on its own."""
    from lychee_pipeline.reranker import collate

    row = _row(images, record_id="a")
    row["query"] = {"text": "red shoes", "image": images["wide"]}
    collator = GroupCollator(processor, group_size=4, seed=3, max_pixels=12544)
    reads = []
    real_load = collate.load_image
    monkeypatch.setattr(collate, "load_image", lambda image, *a: reads.append(image) or real_load(image, *a))
    batch = collator([row])
    monkeypatch.undo()
    assert reads.count(images["wide"]) == 1 and len(reads) == len(set(reads))
    pairs = collator.group_pairs(sample_group(row, 4, 0, 3))
    alone = PairCollator(processor, max_pixels=12544)
    each = alone.encode([alone.prepare(p) for p in pairs])
    for key in each:
        assert torch.equal(batch[key], each[key]), key
    assert collator.stats.as_dict() == alone.stats.as_dict() and collator.stats.pairs == 4
    prepared = [collator.pairs.prepare(p, decode=False) for p in pairs]
    queries = [p[1][0] for p in collator.pairs.decode_batch(prepared)]
    assert all(q is queries[0] for q in queries)  # one image object for the four prompts
