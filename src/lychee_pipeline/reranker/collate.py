"""Batches for the reranker: pairs -> processor outputs, training groups, image budget.

* Left padding, so the scored token is the last one of every row.
* Every processor output is passed through (``mm_token_type_ids`` included: without it the model
  silently falls back to 1-D positions).
* ``max_length`` truncation cuts text only: the document text first, then the query text. Image
  tokens are never cut (cutting them breaks the image-feature / image-token correspondence). The
  number of truncated pairs and tokens is counted in :attr:`PairCollator.stats`.
* Images given as paths are opened at batch time; a broken or missing file raises
  :class:`BrokenImageError` naming the file (never a blank substitute).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .families import DEFAULT_FAMILY, family_for
from .prompt import instruction_for, render_prompt, task_type_of, task_type_or_default

log = logging.getLogger(__name__)

DEFAULT_MIN_PIXELS = 4 * 28 * 28
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
DEFAULT_MAX_LENGTH = 3200


class BrokenImageError(ValueError):
    """An image could not be read at batch time; ``path`` names the file."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot read image {path!r}: {reason}")
        self.path = path


@dataclass
class TruncationStats:
    pairs: int = 0  # pairs collated
    truncated_pairs: int = 0  # pairs whose text was cut
    truncated_tokens: int = 0  # text tokens removed in all
    over_length_pairs: int = 0  # pairs still longer than max_length after removing all text (images too big)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


DRAFT_FACTOR = 4  # decode a JPEG at reduced scale only when it has at least this many times the pixel budget
_SWAPPED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees


def _draft(opened: Any, max_pixels: int | None) -> None:
    """Let libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale (DCT scaling: cheap and antialiased) when the image
    has ``DRAFT_FACTOR`` x the pixel budget or more. The drafted image stays at least as large as the budget's
    size (``Image.draft`` never goes below the requested size), so the processor still resizes *down* to it.
    Header only: nothing is decoded here."""
    if max_pixels is None or getattr(opened, "format", None) != "JPEG":
        return
    width, height = opened.size
    if width * height < DRAFT_FACTOR * max_pixels:
        return
    scale = math.sqrt(max_pixels / (width * height))
    opened.draft("RGB", (max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))))


def load_image(image: Any, max_pixels: int | None = None):
    """A PIL RGB image from a path (turned upright by its EXIF orientation, as a photo viewer shows it) or a
    PIL image (taken as given); :class:`BrokenImageError` naming the file if unreadable.

    ``max_pixels``: the pixel budget the image will be resized to; a JPEG with ``DRAFT_FACTOR`` times more
    pixels is decoded at reduced scale (Pillow's ``Image.draft``), several times faster for large photos.
    """
    from PIL import Image, ImageOps

    if isinstance(image, Image.Image):
        return image.convert("RGB") if image.mode != "RGB" else image
    path = str(image)
    try:
        with Image.open(path) as opened:
            _draft(opened, max_pixels)
            opened.load()  # decode fully now: truncated files fail here, not in the processor
            # phone photos are stored sideways with an orientation tag; training and scoring both read here
            return ImageOps.exif_transpose(opened).convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:  # PIL raises all of these
        raise BrokenImageError(path, f"{type(exc).__name__}: {exc}") from exc


class EachImageOnce:
    """For one processor call, in place of the processor's image processor: each distinct image object of the
    call's ``images`` (in order) is resized and patched once, and its rows repeated where the call repeats it. A
    query image is in each of its candidates' prompts: with 8 candidates a query, one H100 scored 800x800 JPEGs at
    0.74 of its GPU-only rate, the host threads encoding every copy (docs/benchmarks.md, 2026-12-06, fourth lease).
    The outputs are the image processor's own for the distinct images (``pixel_values`` rows per image, in order,
    and ``image_grid_thw``), so the processor's text expansion reads the same grids as without it."""

    def __init__(self, processor: Any, images: Sequence[Any]):
        self.processor = processor
        self.inner = processor.image_processor
        first: dict[int, int] = {}
        self.order = [first.setdefault(id(im), len(first)) for im in images]
        self.distinct = list({id(im): im for im in images}.values())  # first appearances, in order

    def __enter__(self) -> EachImageOnce:
        self.processor.image_processor = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self.processor.image_processor = self.inner

    def __getattr__(self, name: str) -> Any:  # merge_size, patch_size, ... as the processor reads them
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):  # a copy being built, or a protocol lookup
            raise AttributeError(name)
        return getattr(inner, name)

    def __call__(self, images: Any, **kwargs: Any) -> Any:
        if len(images) != len(self.order):  # not the call it was made for: the image processor's own work
            return self.inner(images, **kwargs)
        out = self.inner(self.distinct, **kwargs)
        if set(out.keys()) != {"pixel_values", "image_grid_thw"}:  # an output this class cannot repeat per image
            return self.inner(images, **kwargs)
        grid = out["image_grid_thw"]
        ends = grid.prod(dim=-1).cumsum(0).tolist()
        starts = [0, *ends[:-1]]
        rows = torch.cat([torch.arange(starts[i], ends[i]) for i in self.order])
        out["pixel_values"] = out["pixel_values"][rows]
        out["image_grid_thw"] = grid[self.order]
        return out


class ImageSize:
    """The size an image will have once loaded by :func:`load_image`, read from the file's header only;
    ``source`` is what to load it from later."""

    def __init__(self, size: tuple[int, int], source: Any = None):
        self.size = size
        self.source = source


def image_size(image: Any, max_pixels: int | None = None) -> ImageSize:
    """(width, height) as :func:`load_image` would return the image (draft and EXIF rotation included), without
    decoding it; :class:`BrokenImageError` if the header cannot be read."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return ImageSize(image.size, image)
    path = str(image)
    try:
        with Image.open(path) as opened:
            _draft(opened, max_pixels)
            width, height = opened.size
            orientation = opened.getexif().get(0x0112)
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise BrokenImageError(path, f"{type(exc).__name__}: {exc}") from exc
    return ImageSize((height, width) if orientation in _SWAPPED_ORIENTATIONS else (width, height), image)


def max_pixels_at(progress: float, schedule: Any, default: int | None = None) -> int:
    """``max_pixels`` for the training ``progress`` in [0, 1] under a resolution schedule.

    ``schedule``: a list of ``(start_progress, max_pixels)`` pairs (or a dict ``{start: max_pixels}``);
    the entry with the largest start <= progress applies; before the first start, ``default``
    (or the first entry's value). An int is a constant schedule; ``None`` or empty means ``default``.
    Example: ``[(0.0, 256 * 28 * 28), (0.5, 1280 * 28 * 28)]`` trains at low resolution first.
    """
    if schedule is None:
        if default is None:
            raise ValueError("no resolution schedule and no default")
        return int(default)
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return int(schedule)
    items = sorted((float(k), int(v)) for k, v in (schedule.items() if isinstance(schedule, Mapping) else schedule))
    if not items:
        if default is None:
            raise ValueError("empty resolution schedule and no default")
        return int(default)
    starts = [s for s, _ in items]
    idx = bisect.bisect_right(starts, float(progress)) - 1
    if idx < 0:
        return int(default) if default is not None else items[0][1]
    return items[idx][1]


def _get(item: Any, key: str) -> Any:
    if isinstance(item, Mapping):
        return item.get(key)
    return getattr(item, key, None)


def _as_item(item: Any) -> dict[str, Any]:
    """Plain ``{"text", "image"}`` dict from a row struct (keeps no other keys)."""
    text, image = _get(item, "text"), _get(item, "image")
    return {"text": text if text else None, "image": image if image is not None and image != "" else None}


class PairCollator:
    """Processor outputs for a list of ``(query, doc)`` or ``(query, doc, instruction)`` pairs.

    ``instructions`` overrides the per-task-type defaults (see ``prompt.DEFAULT_INSTRUCTIONS``).
    ``max_pixels`` may be changed between batches (resolution schedule): ``set_max_pixels``.
    ``family``: the ``model_type`` of the model's family (``families.FAMILIES``), whose rule counts image tokens
    (a model's is ``LycheeReranker.family.NAME``).
    """

    def __init__(
        self,
        processor: Any,
        max_length: int = DEFAULT_MAX_LENGTH,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        instructions: Mapping[str, str] | None = None,
        family: str = DEFAULT_FAMILY,
    ):
        if min_pixels > max_pixels:
            raise ValueError(f"min_pixels ({min_pixels}) > max_pixels ({max_pixels})")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        if self.tokenizer.padding_side != "left":
            self.tokenizer.padding_side = "left"
        self.max_length = int(max_length)
        self.min_pixels = int(min_pixels)
        self.max_pixels = int(max_pixels)
        self.instructions = dict(instructions or {})
        self.family = family
        self.family_module = family_for(family)  # its prompt, default instructions and image-token rule
        self.image_token = getattr(processor, "image_token", "<|image_pad|>")
        self.stats = TruncationStats()
        self._warned_over = False

    def set_max_pixels(self, max_pixels: int) -> None:
        self.max_pixels = max(int(max_pixels), self.min_pixels)

    def instruction_for(self, task_type: str) -> str:
        """The instruction of ``task_type``: this collator's overrides, else the family's defaults."""
        return instruction_for(task_type, self.instructions, self.family_module.DEFAULT_INSTRUCTIONS)

    # -- lengths ---------------------------------------------------------------------------------
    def image_tokens(self, image) -> int:
        """LM tokens one (PIL) image becomes under the current pixel budget (the processor's own rule)."""
        width, height = image.size
        return self.family_module.image_tokens(self.processor, height, width, self.min_pixels, self.max_pixels)

    def _count(self, text: str, image_tokens: int, n_images: int) -> int:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return len(ids) - n_images + image_tokens

    def _cut(self, text: str, keep: int) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: max(keep, 0)]
        return self.tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")

    def measure(self, pair: Sequence[Any]) -> int:
        """The token count :meth:`prepare` will give ``pair`` (truncation included), reading only image headers.

        For sorting pairs by length before their images are decoded; not counted in :attr:`stats`."""
        return self.prepare(pair, decode=False)[2]

    def decode(self, prepared: tuple[str, list[Any], int],
               loaded: dict[Any, Any] | None = None) -> tuple[str, list[Any], int]:
        """A pair prepared with ``decode=False``, its images now decoded (the text and count are kept).
        ``loaded``: images already read for this batch, by source; an image several pairs share (a query's image
        in each of its candidates' prompts) is then read once and shared, and :meth:`encode` processes it once."""
        text, images, count = prepared
        return text, [self._read(im.source, loaded) if isinstance(im, ImageSize) else im for im in images], count

    def _read(self, source: Any, loaded: dict[Any, Any] | None) -> Any:
        """:func:`load_image` at this collator's budget; with ``loaded`` (a batch's images by source) once a source."""
        if loaded is None:
            return load_image(source, self.max_pixels)
        key = source if isinstance(source, (str, os.PathLike)) else id(source)
        if key not in loaded:
            loaded[key] = load_image(source, self.max_pixels)
        return loaded[key]

    def decode_batch(self, prepared: Sequence[tuple[str, list[Any], int]]) -> list[tuple[str, list[Any], int]]:
        """:meth:`decode` for the pairs of one batch, each image source read once."""
        loaded: dict[Any, Any] = {}
        return [self.decode(p, loaded) for p in prepared]

    def prepare(self, pair: Sequence[Any], decode: bool = True, count: bool | None = None,
                loaded: dict[Any, Any] | None = None) -> tuple[str, list[Any], int]:
        """(prompt text with one placeholder per image, PIL images in order, final token count).

        ``decode=False``: images are only sized from their headers (:class:`ImageSize`; :meth:`decode` loads
        them later). ``count``: add the pair to :attr:`stats` (default: when decoding). ``loaded``: as
        :meth:`decode`'s, an image the batch's pairs share read once."""
        count_stats = decode if count is None else count
        if len(pair) == 3:
            query, doc, instruction = pair
        else:
            query, doc = pair
            instruction = None
        query, doc = _as_item(query), _as_item(doc)
        if instruction is None:
            instruction = self.instruction_for(task_type_or_default(query, doc))
        build_messages = self.family_module.build_messages
        images = [self._read(item["image"], loaded) if decode else image_size(item["image"], self.max_pixels)
                  for item in (query, doc) if item["image"] is not None]
        img_tokens = sum(self.image_tokens(im) for im in images)
        messages = build_messages(query, doc, instruction)
        text = render_prompt(self.processor, messages)
        count = self._count(text, img_tokens, len(images))
        stats = self.stats if count_stats else TruncationStats()
        stats.pairs += 1
        if count <= self.max_length:
            return text, images, count

        original = count
        # cut the document text first, then the query text; keep one token of a text-only item
        for item in (doc, query):
            if count <= self.max_length or not item["text"]:
                continue
            n_ids = len(self.tokenizer(item["text"], add_special_tokens=False)["input_ids"])
            floor = 0 if item["image"] is not None else 1
            keep = max(n_ids - (count - self.max_length), floor)
            full_text = item["text"]
            while True:
                item["text"] = self._cut(full_text, keep) or None
                text = render_prompt(self.processor, build_messages(query, doc, instruction))
                count = self._count(text, img_tokens, len(images))
                if count <= self.max_length or keep <= floor:
                    break
                keep = max(keep - max(count - self.max_length, 1), floor)
        stats.truncated_pairs += 1
        stats.truncated_tokens += original - count
        if count > self.max_length:
            stats.over_length_pairs += 1
            if count_stats and not self._warned_over:
                log.warning(
                    "a pair needs %d tokens (> max_length %d) even without text: its images are too large; "
                    "lower max_pixels or raise max_length (image tokens are never truncated)",
                    count,
                    self.max_length,
                )
                self._warned_over = True
        return text, images, count

    # -- batching --------------------------------------------------------------------------------
    def encode(self, prepared: Sequence[tuple[str, list[Any], int]]) -> dict[str, Any]:
        texts = [p[0] for p in prepared]
        images = [im for p in prepared for im in p[1]]
        kwargs: dict[str, Any] = {"text": texts, "padding": True, "return_tensors": "pt"}
        if images:
            kwargs["images"] = images
            kwargs["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        shared = len({id(im) for im in images}) < len(images)
        with EachImageOnce(self.processor, images) if shared else contextlib.nullcontext():
            out = self.processor(**kwargs)
        batch = dict(out.items())
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        expected = [p[2] for p in prepared]
        if lengths != expected:
            raise RuntimeError(f"token count mismatch between collator ({expected}) and processor ({lengths})")
        return batch

    def __call__(self, pairs: Sequence[Sequence[Any]]) -> dict[str, Any]:
        if not pairs:
            raise ValueError("no pairs to collate")
        # an image the batch's pairs share (a training group's query image in each of its documents' prompts) is
        # read once, with no header pass first, and patched once (encode)
        loaded: dict[Any, Any] = {}
        return self.encode([self.prepare(p, loaded=loaded) for p in pairs])


def _as_list(value: Any) -> list[Any]:
    """A row's list column as a list (None, list, tuple or numpy array from pandas / Arrow)."""
    return [] if value is None else list(value)


def _is_hard(negative: Any) -> bool:
    flag = _get(negative, "hard")
    return True if flag is None else bool(flag)  # given negatives are mined unless marked otherwise


#: ``training.negative_fill``: fill a short group with other records' documents, or refuse the record.
NEGATIVE_FILL_POLICIES = ("fill_random", "refuse")


class ShortGroupError(ValueError):
    """A record has fewer negatives than ``group_size - 1`` and its group cannot (or may not) be filled."""


def _content(doc: Any) -> tuple[str | None, str | None]:
    """What a document shows the model: (text, image), empty values as None."""
    item = _as_item(doc)
    return item["text"], item["image"]


def _draw_keys(doc: Any) -> tuple[tuple[str | None, str | None], str | None]:
    """How the draw tells documents apart: (content (text, image), doc_id as text or None). Two documents are the
    same when either is equal."""
    doc_id = _get(doc, "doc_id")
    return _content(doc), None if doc_id is None else str(doc_id)


def _fill_negatives(
    record_id: str,
    positives: list[Any],
    taken: list[Any],
    count: int,
    pool: Sequence[Mapping[str, Any]],
    rng: random.Random,
) -> list[dict[str, Any]]:
    """``count`` random documents of other records of ``pool`` (their positives or negatives), marked
    ``hard=False``: never one of this record's positives (same ``doc_id`` or same text and image), never a
    document already in the group (same ``doc_id`` or content). Random picks first; if they run out of tries
    (the usable documents are rare in a large pool), every candidate in a seeded order, so a record that
    :func:`drawable_negative_counts` says can be filled is filled. Raises :class:`ShortGroupError` when the pool
    has too few such documents."""
    banned_ids = {str(_get(d, "doc_id")) for d in [*positives, *taken] if _get(d, "doc_id") is not None}
    banned = {_content(p) for p in positives} | {_content(n) for n in taken}
    chosen: list[dict[str, Any]] = []

    def take(doc: Any) -> None:
        key, doc_id = _draw_keys(doc)
        if key == (None, None) or key in banned or (doc_id is not None and doc_id in banned_ids):
            return
        banned.add(key)
        if doc_id is not None:
            banned_ids.add(doc_id)
        chosen.append({"doc_id": _get(doc, "doc_id"), "text": key[0], "image": key[1], "hard": False})

    tries, max_tries = 0, 64 * count + 256
    while len(chosen) < count and tries < max_tries and len(pool) >= 2:
        tries += 1
        other = pool[rng.randrange(len(pool))]
        if str(_get(other, "record_id")) == record_id:
            continue
        docs = _as_list(_get(other, "positives")) + _as_list(_get(other, "negatives"))
        if docs:
            take(docs[rng.randrange(len(docs))])
    if len(chosen) < count:  # the random tries ran out: every candidate, in an order drawn from the same stream
        candidates = [doc for other in pool if str(_get(other, "record_id")) != record_id
                      for doc in _as_list(_get(other, "positives")) + _as_list(_get(other, "negatives"))]
        rng.shuffle(candidates)
        for doc in candidates:
            if len(chosen) == count:
                break
            take(doc)
    if len(chosen) < count:
        raise ShortGroupError(
            f"record {record_id}: could not draw {count} random negatives from the other {len(pool) - 1} "
            f"training records (too few distinct documents that are not its positives); add negatives or "
            f"records, or lower training.group_size"
        )
    return chosen


def drawable_negative_counts(pool: Sequence[Mapping[str, Any]]) -> list[int]:
    """For each row of ``pool`` (the training table's rows), how many documents :func:`_fill_negatives` can
    always draw for it: the distinct documents of the other rows that are neither one of its own positives nor
    one of its own negatives, compared as the draw compares them (same ``doc_id``, or same text and image).

    Documents linked by an equal ``doc_id`` or an equal content count as one (the draw is sure to get one of
    each such class; with ids reused for different contents it may get more): a row can fill its group when
    ``len(negatives) + count >= group_size - 1``. Linear in the number of documents.
    """
    parent: dict[Any, Any] = {}

    def find(node: Any) -> Any:
        root = node
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[node] != root:  # path compression
            parent[node], node = root, parent[node]
        return root

    rows = []
    for row in pool:
        nodes = []
        for doc in _as_list(_get(row, "positives")) + _as_list(_get(row, "negatives")):
            key, doc_id = _draw_keys(doc)
            ends = [("content", key)] if key != (None, None) else []
            ends += [("id", doc_id)] if doc_id is not None else []
            for end in ends[1:]:
                parent[find(end)] = find(ends[0])
            nodes.append((ends[0] if ends else None, key != (None, None)))
        rows.append(nodes)
    drawable = {find(node) for nodes in rows for node, usable in nodes if usable}  # classes with a usable doc
    return [len(drawable) - len({find(node) for node, _ in nodes if node is not None} & drawable) for nodes in rows]


def sample_group(
    row: Mapping[str, Any],
    group_size: int,
    epoch: int = 0,
    seed: int = 0,
    fill_pool: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """One training group for a model-input row: 1 positive + ``group_size - 1`` negatives.

    Drawn by ``(seed, epoch, record_id)``, so each epoch re-draws. Negatives: mined ones
    (``hard=True``) first, up to half the negatives, then random ones (``hard=False``); if one kind
    runs short the other fills in. When the row has fewer than ``group_size - 1`` negatives in all:
    with a ``fill_pool`` (the rows of the same split, e.g. the training table) the rest of the group is
    drawn from other records' documents (:func:`_fill_negatives`, marked ``hard=False``), a pure function
    of ``(seed, epoch, record_id)`` and the pool; without one, :class:`ShortGroupError` (a ValueError).
    Returns ``{"record_id", "query", "docs", "task_type", "doc_ids", "hard", "filled"}`` with the positive
    first in ``docs``; ``hard`` flags the negatives, ``filled`` counts the slots filled from the pool.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (1 positive + negatives), got {group_size}")
    record_id = str(_get(row, "record_id"))
    positives = _as_list(_get(row, "positives"))
    negatives = _as_list(_get(row, "negatives"))
    if not positives:
        raise ValueError(f"record {record_id} has no positive document")
    need = group_size - 1
    if len(negatives) < need and fill_pool is None:
        raise ShortGroupError(
            f"record {record_id} has {len(negatives)} negatives but group_size={group_size} needs {need}"
        )
    rng = random.Random(f"{seed}:{epoch}:{record_id}")
    positive = positives[rng.randrange(len(positives))]
    hard = [n for n in negatives if _is_hard(n)]
    easy = [n for n in negatives if not _is_hard(n)]
    rng.shuffle(hard)
    rng.shuffle(easy)
    n_hard = min(len(hard), math.ceil(need / 2))
    n_easy = min(len(easy), need - n_hard)
    n_hard = min(len(hard), need - n_easy)  # hard ones fill in when random ones run short
    chosen = hard[:n_hard] + easy[:n_easy]
    filled: list[dict[str, Any]] = []
    if len(chosen) < need:  # only with a fill pool (checked above); its own stream, so the draw above is unchanged
        fill_rng = random.Random(f"{seed}:{epoch}:{record_id}:fill")
        filled = _fill_negatives(record_id, positives, chosen, need - len(chosen), fill_pool, fill_rng)
    negs = chosen + filled
    return {
        "record_id": record_id,
        "query": _as_item(_get(row, "query")),
        "docs": [_as_item(positive)] + [_as_item(n) for n in negs],
        "task_type": _get(row, "task_type"),
        "doc_ids": [_get(positive, "doc_id")] + [_get(n, "doc_id") for n in negs],
        "hard": [_is_hard(n) for n in negs],
        "filled": len(filled),
    }


@dataclass
class FillStats:
    """Counts of the groups this collator built (a loader that reads ahead collates a batch or two more than
    are trained on)."""

    groups: int = 0  # groups built
    filled_groups: int = 0  # groups with at least one slot filled from other records
    filled_slots: int = 0  # negatives drawn from other records' documents (hard=False)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class GroupCollator:
    """Model-input rows -> one batch of ``len(rows) * group_size`` pairs plus ``labels`` [B*G] float
    (1.0 for the positive, first in each group) and ``group_size`` (int).

    The instruction of a group follows the row's ``task_type`` (so all documents of a query share it).
    Call :meth:`set_epoch` each epoch (negatives are re-drawn) and :meth:`set_max_pixels` for a
    resolution schedule. Truncation counts are in ``stats``.

    ``negative_fill`` (``training.negative_fill``): ``"refuse"`` raises :class:`ShortGroupError` for a row
    with fewer than ``group_size - 1`` negatives; ``"fill_random"`` fills its group from other rows of
    ``fill_pool`` (see :func:`sample_group`); the filled slots are counted in ``fill_stats``.
    ``family``: as :class:`PairCollator`'s.
    """

    def __init__(
        self,
        processor: Any,
        group_size: int = 8,
        max_length: int = DEFAULT_MAX_LENGTH,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        instructions: Mapping[str, str] | None = None,
        seed: int = 0,
        epoch: int = 0,
        negative_fill: str = "refuse",
        fill_pool: Sequence[Mapping[str, Any]] | None = None,
        family: str = DEFAULT_FAMILY,
    ):
        if negative_fill not in NEGATIVE_FILL_POLICIES:
            raise ValueError(f"negative_fill must be one of {NEGATIVE_FILL_POLICIES}, got {negative_fill!r}")
        if negative_fill == "fill_random" and fill_pool is None:
            raise ValueError("negative_fill='fill_random' needs fill_pool (the rows of the split, e.g. the dataset)")
        self.pairs = PairCollator(processor, max_length, min_pixels, max_pixels, instructions, family)
        self.group_size = int(group_size)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.negative_fill = negative_fill
        self.fill_pool = fill_pool if negative_fill == "fill_random" else None
        self.fill_stats = FillStats()

    @property
    def stats(self) -> TruncationStats:
        return self.pairs.stats

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def set_max_pixels(self, max_pixels: int) -> None:
        self.pairs.set_max_pixels(max_pixels)

    def group_pairs(self, group: Mapping[str, Any]) -> list[tuple[Any, Any, str]]:
        """``(query, doc, instruction)`` of a sampled group: every document under its record's task type (or,
        without one, the positive's), the rule scoring follows when given the record's task type."""
        task_type = group["task_type"] or task_type_of(group["query"], group["docs"][0])
        instruction = self.pairs.instruction_for(task_type)
        return [(group["query"], doc, instruction) for doc in group["docs"]]

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        pairs = []
        for row in rows:
            group = sample_group(row, self.group_size, self.epoch, self.seed, self.fill_pool)
            self.fill_stats.groups += 1
            self.fill_stats.filled_groups += bool(group["filled"])
            self.fill_stats.filled_slots += group["filled"]
            pairs.extend(self.group_pairs(group))
        batch = self.pairs(pairs)
        labels = torch.zeros(len(pairs), dtype=torch.float32)
        labels[:: self.group_size] = 1.0
        batch["labels"] = labels
        batch["group_size"] = self.group_size
        return batch
