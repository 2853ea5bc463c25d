"""The vision tower's features of images already scored, kept on the device (scoring with packed pairs).

A test set or a rerank file lists the same document image under many queries: the demo test set holds 1,792
document images of which 319 are distinct, and a catalogue's top candidates recur from query to query. The frozen
tower gives an image the same features whatever pair it sits in, so the scorer runs each distinct image through
the tower once and keeps its merged features (and Qwen3-VL's DeepStack features) in a least-recently-used cache of
a fixed size, keyed by the image's pixels as the tower sees them (their bytes, grid and dtype: the same file at
another pixel budget is another image; two paths to the same pixels are one).

Keys are hashed on the host where the batch is prepared (:func:`image_keys`, called by ``packing.pack_batch``); the
lookup happens in the forward (:func:`cached_tower_features`), which runs only the images it has not seen, reading
nothing back from the device. Features depend on the tower's weights: the cache empties itself when any of them is
replaced or changed in place (:meth:`VisionFeatureCache.follow`), so a model trained between two scoring calls
never gets the features of its former weights.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

GIB = 2**30
# auto: what a scorer may hold without crowding the model's own activations. An image of the 7B model at the
# pipeline's default pixel budget (~1,000 merged tokens × 3,584 × bf16) is ~7 MiB: 4 GiB keep ~580 of them.
AUTO_CUDA_MAX_BYTES = 4 * GIB
AUTO_CUDA_SHARE = 0.05  # of the card's memory, where that is less (a 24 GB card: 1.2 GiB)
AUTO_CPU_BYTES = 2 * GIB


def cache_bytes(setting: float | int | str | None, device: torch.device | str) -> int:
    """The cache's size in bytes for the ``vision_cache_gib`` setting: ``"auto"`` (on a CUDA device the smaller of
    4 GiB and 5% of its memory, else 2 GiB of host memory), a number of GiB (0 turns the cache off) or None (off)."""
    if setting is None:
        return 0
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            return int(min(AUTO_CUDA_MAX_BYTES, AUTO_CUDA_SHARE * total))
        return AUTO_CPU_BYTES
    try:
        gib = float(setting)
    except (TypeError, ValueError):
        gib = float("nan")
    if not gib >= 0:  # also NaN
        raise ValueError(f"vision_cache_gib must be 'auto' or a number of GiB >= 0 (0: off), got {setting!r}")
    return int(gib * GIB)


@dataclass(frozen=True)
class ImageFeatures:
    """One image's vision features as the language model takes them: the merged tokens and, for a tower with
    DeepStack (Qwen3-VL), one tensor per DeepStack layer (empty otherwise); each [image tokens, hidden]."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))

    def clone(self) -> ImageFeatures:
        # the tower returns views of one batch-sized output: a kept view would hold the whole output alive
        return ImageFeatures(self.embeds.clone(), tuple(t.clone() for t in self.deepstack))


def image_keys(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> tuple[bytes, ...]:
    """A 16-byte key per image of a batch: sha256 of its grid, the pixels' dtype and its pixel rows' bytes (host
    tensors; the rows of image i follow those of image i-1, ``t*h*w`` of them)."""
    grid = image_grid_thw.cpu()
    counts = grid.prod(-1).tolist()
    pixels = pixel_values.contiguous()
    keys, start = [], 0
    for (t, h, w), count in zip(grid.tolist(), counts):
        digest = hashlib.sha256(f"{t},{h},{w},{pixels.dtype}".encode())
        digest.update(pixels[start:start + count].view(torch.uint8).numpy().data)
        keys.append(digest.digest()[:16])
        start += count
    return tuple(keys)


def _weights_stamp(tower: nn.Module) -> tuple:
    """What changes when the tower's weights do: a replaced tensor (new storage, dtype or device) or an in-place
    update (its version counter, which every optimizer step and ``copy_`` bumps)."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in tower.parameters())


class VisionFeatureCache:
    """Least-recently-used :class:`ImageFeatures` by image key, at most ``max_bytes`` of them. Used by one thread
    (the one that runs the model)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[bytes, ImageFeatures] = OrderedDict()
        self._stamp: tuple | None = None
        self.bytes = 0
        self.images = 0  # images of the batches looked up
        self.through_tower = 0  # ... of which the tower ran

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def follow(self, tower: nn.Module) -> None:
        """Empty the cache if ``tower``'s weights are not those its features came from."""
        stamp = _weights_stamp(tower)
        if stamp != self._stamp:
            self.clear()
            self._stamp = stamp

    def get(self, key: bytes) -> ImageFeatures | None:
        features = self._entries.get(key)
        if features is not None:
            self._entries.move_to_end(key)
        return features

    def put(self, key: bytes, features: ImageFeatures) -> None:
        """Keep a copy of ``features``, dropping the least recently used entries to stay within the size; an image
        larger than the whole cache is not kept."""
        size = features.nbytes
        if key in self._entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.nbytes
        self._entries[key] = features.clone()
        self.bytes += size

    def discard(self, key: bytes) -> None:
        dropped = self._entries.pop(key, None)
        if dropped is not None:
            self.bytes -= dropped.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {"images": self.images, "through_tower": self.through_tower, "entries": len(self._entries),
                "bytes": self.bytes, "max_bytes": self.max_bytes}


def tower_features(vl_model: nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                   precomputed: dict[str, Any]) -> list[ImageFeatures]:
    """Each image's features from one call of the vision tower (``precomputed``: the family's grid-derived
    inputs, see ``vision_inputs_on_host``)."""
    output = vl_model.get_image_features(pixel_values, image_grid_thw, return_dict=True, **precomputed)
    layers = getattr(output, "deepstack_features", None) or []
    return [ImageFeatures(embeds, tuple(layer[i] for layer in layers))
            for i, embeds in enumerate(output.pooler_output)]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # from page-locked memory: a copy from pageable memory waits for the device's queued work
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def cached_tower_features(vl_model: nn.Module, packed: Any, cache: VisionFeatureCache) -> ImageFeatures:
    """The features of every image of ``packed`` (a ``PackedBatch`` on the model's device with ``image_keys``),
    concatenated in the batch's image order: those in ``cache`` from it, the others (each distinct image once) from
    one tower call, then kept. When no image of the batch is known or repeated, the tower call takes the inputs the
    batch brought; otherwise the missing images' pixel rows are gathered and their grid-derived inputs computed here,
    on the host (nothing is read back from the device)."""
    from .families import family_of_model
    from .families.segments import map_segment_rows

    keys, grid = packed.image_keys, packed.image_grid_thw
    cache.follow(vl_model.visual)
    found = {key: cache.get(key) for key in dict.fromkeys(keys)}
    missing = [key for key, features in found.items() if features is None]
    if len(missing) == len(keys):  # all new and distinct: the batch as prepared
        computed = tower_features(vl_model, packed.pixel_values, grid,
                                  {**packed.vision_to_device, **packed.vision_on_host})
    elif missing:
        first = [keys.index(key) for key in missing]
        counts = grid.prod(-1)
        starts = (counts.cumsum(0) - counts).tolist()
        device = packed.pixel_values.device
        rows = torch.cat([torch.arange(starts[i], starts[i] + int(counts[i])) for i in first])
        subset = grid[first]
        to_device, on_host = family_of_model(vl_model).vision_inputs_on_host(vl_model.config.vision_config, subset)
        moved = {k: _to_device(v, device) for k, v in to_device.items()}
        moved.update(map_segment_rows(on_host, lambda t: _to_device(t, device)))
        pixels = packed.pixel_values.index_select(0, _to_device(rows, device))
        computed = tower_features(vl_model, pixels, subset, moved)
    else:
        computed = []
    for key, features in zip(missing, computed):
        found[key] = features
        cache.put(key, features)
    cache.images += len(keys)
    cache.through_tower += len(missing)
    per_image = [found[key] for key in keys]
    layers = len(per_image[0].deepstack)
    return ImageFeatures(torch.cat([f.embeds for f in per_image]),
                         tuple(torch.cat([f.deepstack[i] for f in per_image]) for i in range(layers)))
