"""The scoring pipeline: host preparation in a thread ahead of the model, same batches, same scores, same order;
JPEGs far above the pixel budget decoded at reduced scale, with token counts known from the header."""

from __future__ import annotations

import threading

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker import Reranker
from lychee_pipeline.reranker.collate import BrokenImageError, PairCollator, image_size, load_image
from lychee_pipeline.reranker.vision_cache import VisionFeatureCache


@pytest.fixture(scope="module")
def reranker(tiny_dir):
    return Reranker.from_pretrained("builtin:tiny", device="cpu", batch_size=3, tiny_cache_dir=tiny_dir)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> dict[str, str]:
    """A large JPEG (far above a small budget), a rotated one (EXIF orientation 6), a small one."""
    folder = tmp_path_factory.mktemp("jpegs")
    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, (w, h) in {"large": (1600, 1200), "rotated": (640, 400), "small": (96, 80)}.items():
        pixels = (torch.rand(h // 8, w // 8, 3, generator=gen) * 255).to(torch.uint8).numpy()
        image = Image.fromarray(pixels).resize((w, h), Image.BILINEAR)
        path = folder / f"{name}.jpg"
        if name == "rotated":
            exif = Image.Exif()
            exif[0x0112] = 6
            image.save(path, quality=90, exif=exif.tobytes())
        else:
            image.save(path, quality=90)
        out[name] = str(path)
    return out


def _pairs(images, jpegs):
    query = {"text": "red shoes", "image": None}
    docs = [
        {"text": "red running shoes for women with a mesh upper", "image": None},
        {"text": None, "image": images["red"]},
        {"text": "a blue bag " * 12, "image": images["blue"]},
        {"text": "x", "image": None},
        {"text": "green " * 30, "image": images["wide"]},
        {"text": "a large photo", "image": jpegs["large"]},
        {"text": "turned", "image": jpegs["rotated"]},
        {"text": None, "image": jpegs["small"]},
        {"text": "a pil image", "image": Image.open(images["green"]).convert("RGB")},
        {"text": "shoes " * 50, "image": None},
    ]
    other = {"text": "blue bag", "image": images["blue"]}
    return [(query, d) for d in docs] + [(other, d) for d in docs[::-1]]


def serial_scores(scorer: Reranker, pairs, bounds=None) -> list[float]:
    """The scoring loop as it was before the pipeline, written out: whole chunk prepared (images decoded),
    sorted by token count, batched, one batch at a time. ``bounds``: other chunks than every chunk_size. With the
    scorer's vision feature cache on, a fresh one of its own: an image's features then come from the same batch as
    the scorer's (its first), so the scores match bit for bit."""
    out = [0.0] * len(pairs)
    cache = None if scorer.vision_cache is None else VisionFeatureCache(scorer.vision_cache.max_bytes)
    collator = PairCollator(scorer.model.processor, scorer.collator.max_length, scorer.collator.min_pixels,
                            scorer.collator.max_pixels)
    if bounds is None:
        bounds = [(s, s + scorer.chunk_size) for s in range(0, len(pairs), scorer.chunk_size)]
    with torch.inference_mode():
        for start, end in bounds:
            chunk = [collator.prepare(p) for p in pairs[start:end]]
            order = sorted(range(len(chunk)), key=lambda i: chunk[i][2])
            for b in range(0, len(order), scorer.batch_size):
                idx = order[b : b + scorer.batch_size]
                batch = scorer.model.host_inputs(collator.encode([chunk[i] for i in idx]), keyed_images=cache is not None)
                probs = scorer.model.probabilities(scorer.model(**batch, vision_cache=cache))
                for i, p in zip(idx, probs.float().tolist()):
                    out[start + i] = float(p)
    return out


@pytest.mark.parametrize("max_pixels", [12544, 1003520])
def test_prefetched_scoring_gives_the_serial_scores_exactly(reranker, images, jpegs, max_pixels):
    """Chunks of 6 pairs in batches of 3 (several chunks, a ragged last one); 20 pairs of every kind."""
    pairs = _pairs(images, jpegs)
    scorer = Reranker(reranker.model, batch_size=3, chunk_batches=2, max_pixels=max_pixels)
    expected = serial_scores(scorer, pairs)
    assert scorer.score_pairs(pairs) == expected  # bit for bit, in input order
    inline = Reranker(reranker.model, batch_size=3, chunk_batches=2, max_pixels=max_pixels, prefetch_batches=0)
    assert inline.score_pairs(pairs) == expected
    assert len(set(expected)) > 10


def test_several_preparing_threads_give_the_serial_scores_and_counts(reranker, images, jpegs):
    """Three host threads, each with its own processor copy: same batches, same scores bit for bit, the
    truncation counts back on the scorer's collator; called twice (the copies are reused)."""
    pairs = _pairs(images, jpegs)
    scorer = Reranker(reranker.model, batch_size=3, chunk_batches=2, max_pixels=12544, max_length=60,
                      prepare_workers=3)
    expected = serial_scores(scorer, pairs)
    for call in (1, 2):
        before = threading.active_count()
        assert scorer.score_pairs(pairs) == expected
        assert scorer.collator.stats.pairs == call * len(pairs)
        assert threading.active_count() == before  # the pool's threads are gone
    assert scorer.collator.stats.truncated_pairs > 0 and len(scorer.preparation.clones) == 3


def test_a_small_first_batch_starts_the_device_early_with_the_same_scores(reranker, images, jpegs):
    """``first_batch=2``: a first chunk of 2 pairs, then chunks of 1, 2 ... batches (up to chunk_size), each
    sorted; the scores are those of a serial loop over the same chunks, close to the unsplit ones. A first batch
    much smaller than a batch doubles until it reaches one."""
    pairs = _pairs(images, jpegs)
    split = Reranker(reranker.model, batch_size=3, chunk_batches=2, max_pixels=12544, first_batch=2)
    bounds = split.chunk_bounds(len(pairs))
    assert bounds == [(0, 2), (2, 5), (5, 11), (11, 17), (17, 20)]
    ramp = Reranker(reranker.model, batch_size=32, chunk_batches=4, first_batch=4).chunk_bounds(300)
    assert ramp[:6] == [(0, 4), (4, 12), (12, 28), (28, 60), (60, 124), (124, 252)]
    assert Reranker(reranker.model, batch_size=3, chunk_batches=2).chunk_bounds(20)[:2] == [(0, 6), (6, 12)]
    assert split.chunk_bounds(3) == [(0, 3)]  # one batch of input: no split
    expected = serial_scores(split, pairs, bounds)
    positions = [p for p, _ in split.batches(pairs)]
    assert positions[0] == [0, 1] or positions[0] == [1, 0]
    for workers in (1, 3):
        split.prepare_workers = workers
        assert split.preparation.threads() == workers  # the setting reaches the preparing threads
        assert split.score_pairs(pairs) == expected
    unsplit = Reranker(reranker.model, batch_size=3, chunk_batches=2, max_pixels=12544).score_pairs(pairs)
    assert max(abs(a - b) for a, b in zip(expected, unsplit)) < 1e-4  # only the padding differs


def test_batches_are_length_sorted_within_chunks_and_cover_every_pair(reranker, images, jpegs):
    pairs = _pairs(images, jpegs)
    scorer = Reranker(reranker.model, batch_size=3, chunk_batches=2, max_pixels=12544)
    seen, lengths = [], []
    for positions, batch in scorer.batches(pairs):
        seen += positions
        packed = batch["packed"]  # the default model packs pairs: the batch is prepared as one packed sequence
        assert packed.pairs == len(positions)
        lengths.append((positions[0] // 6, list(packed.plan.lengths)))
    assert sorted(seen) == list(range(len(pairs)))
    for chunk in {c for c, _ in lengths}:
        flat = [n for c, rows in lengths if c == chunk for n in rows]
        assert flat == sorted(flat)


def test_a_broken_image_stops_the_host_thread_and_reaches_the_caller(reranker, images):
    pairs = [({"text": "q", "image": None}, {"text": f"doc {i}", "image": images["red"]}) for i in range(12)]
    pairs.append(({"text": "q", "image": None}, {"text": "bad", "image": images["broken"]}))
    before = {t.ident for t in threading.enumerate()}
    scorer = Reranker(reranker.model, batch_size=2, chunk_batches=2)
    with pytest.raises(BrokenImageError, match="broken.png"):
        scorer.score_pairs(pairs)
    left = [t for t in threading.enumerate() if t.ident not in before and t.name == "lychee-score-prefetch"]
    assert not left
    with pytest.raises(BrokenImageError, match="broken.png"):  # the same with a pool of preparing threads
        Reranker(reranker.model, batch_size=2, chunk_batches=2, prepare_workers=2).score_pairs(pairs)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("lychee-score")]


def test_large_jpegs_are_drafted_and_headers_give_the_loaded_size(jpegs):
    budget = 12544  # 112 x 112: the 1600 x 1200 photo has 150x the budget
    full = load_image(jpegs["large"])
    drafted = load_image(jpegs["large"], budget)
    assert full.size == (1600, 1200)
    assert drafted.size == (200, 150)  # 1/8 scale by libjpeg, still above the budget's 129 x 97
    assert drafted.size[0] * drafted.size[1] >= budget
    assert image_size(jpegs["large"], budget).size == drafted.size
    assert load_image(jpegs["small"], budget).size == (96, 80)  # under 4x the budget: decoded as is
    rotated = load_image(jpegs["rotated"], budget)
    assert rotated.size == (100, 160)  # 640 x 400 drafted to 1/4, then turned upright by its EXIF tag
    assert image_size(jpegs["rotated"], budget).size == (100, 160)
    assert load_image(jpegs["rotated"]).size == image_size(jpegs["rotated"]).size == (400, 640)
    # reduced-scale decoding is close to decoding in full and resizing (same picture, not a different one)
    a = torch.tensor(list(drafted.resize((100, 75)).getdata()), dtype=torch.float32)
    b = torch.tensor(list(full.resize((100, 75), Image.BOX).getdata()), dtype=torch.float32)
    assert (a - b).abs().mean() < 12.0  # (unrelated pictures differ by ~80 per channel)


def test_measure_equals_the_prepared_count_and_counts_nothing(reranker, images, jpegs):
    collator = PairCollator(reranker.model.processor, max_length=40, max_pixels=12544)
    for pair in _pairs(images, jpegs):
        measured = collator.measure(pair)
        before = collator.stats.pairs
        assert collator.prepare(pair)[2] == measured
        assert collator.stats.pairs == before + 1
    assert collator.stats.truncated_pairs > 0  # max_length 40 cut some texts: measure saw the same cut


def test_the_fast_image_processor_is_used_exactly_when_torchvision_is_installed(reranker):
    from transformers.utils import is_torchvision_available

    from lychee_pipeline.reranker.families.qwen2_5_vl.processor import image_processor_kind

    assert image_processor_kind(reranker.model.processor) == ("fast" if is_torchvision_available() else "pil")


def test_auto_prepares_in_one_thread_where_the_model_shares_the_cpu(reranker):
    """Two preparing threads only on a GPU whose packed attention is one variable-length call per layer (the
    launching thread is then light) with the CPUs for them; on a CPU the host threads and the model share the
    cores (docs/benchmarks.md, "Short calls, and two preparing threads")."""
    from lychee_pipeline.reranker.preparation import auto_preparing_threads

    assert auto_preparing_threads("cuda", True, 16) == 2
    assert auto_preparing_threads("cuda", False, 16) == 1  # per-pair attention calls: the launching thread is busy
    assert auto_preparing_threads("cuda", True, 2) == 1
    assert auto_preparing_threads("cpu", True, 16) == 1
    assert Reranker(reranker.model).preparation.threads() == 1  # this machine: the model on the CPU
    assert Reranker(reranker.model, prepare_workers=3).preparation.threads() == 3
