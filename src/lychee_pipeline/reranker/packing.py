"""Packing a group's pairs into one sequence: no padding tokens through the language model.

The collator pads every pair of a micro-batch to its longest row (left padding): at the Lychee shape (8
pairs, ~853 tokens each) 12% of the tokens the decoder processes are padding. :func:`packed_last_hidden`
instead concatenates the real tokens of all rows into one sequence of batch 1 and runs the decoder on that,
with three things kept equal to the padded path:

* **mRoPE positions.** Qwen2.5-VL's 3-D positions (temporal, height, width) are computed for the padded batch
  by the model's own ``get_rope_index`` (as the unpacked forward does), then only the real tokens are kept
  and concatenated: every pair's positions start again at 0 and its image tokens get the same 3-D grid as
  when padded.
* **Attention stays within a pair** (block-diagonal, causal inside each block). The language model's
  attention is switched to :data:`PACKED_ATTENTION`, an attention function registered with transformers that
  runs one causal SDPA call per pair (``is_causal=True``, no mask tensor) when the forward carries a
  :class:`PackPlan`, and is plain SDPA otherwise. Without a mask, SDPA on a CUDA GPU takes its
  flash-attention kernel, and each call only computes its own pair's triangle — no dense T×T mask.
  (transformers' own packed-sequence detection would build a dense 4-D boolean mask for SDPA, which forces
  the slower memory-efficient kernel over the whole T×T square, ~6× the attention work of 8 pairs; its
  flex-attention path compiles ``flex_attention`` with ``dynamic=False``, so every new packed length would
  recompile; the flash-attn package is not installed on the machines this project runs on.) When scoring on
  CUDA (no gradients), the pairs share one call of PyTorch's own variable-length flash attention per layer
  (``torch.nn.attention.varlen``, torch >= 2.10) instead of one SDPA call per pair.
* **The score** is read at each pair's last real token (``cumsum(lengths) - 1`` in the packed sequence).

Everything that depends only on the inputs' shapes — the packed ids, the positions, the bounds, where the
image tokens go, the vision tower's grid-derived inputs — is worked out on the host by :func:`pack_batch`
into a :class:`PackedBatch`. The scorer does that in its preparing thread, before the batch goes to the
device, so the forward never waits for the device (``Reranker``; a padded batch given to the forward is
packed there, after reading its ids back). The vision tower takes every image's patches as one flattened
sequence already. Only torch and transformers are needed.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .vision_cache import ImageFeatures, VisionFeatureCache, cached_tower_features, image_keys, tower_features

PACKED_ATTENTION = "lychee_packed_sdpa"
PLAN_KWARG = "lychee_pack_cu_seqlens"  # the keyword the plan travels under, from the model's forward to attention
_REGISTERED = False


_BOUNDS_ATTR = "_lychee_pack_bounds"
_KEYS_ATTR = "_lychee_pack_keys"  # (key rows, their cu_seqlens, the longest) of a plan with shared prefixes


@dataclass(frozen=True)
class PackPlan:
    """Where each pair lies in the packed sequence: pair ``i`` is ``[starts[i], ends[i])``.

    With shared prefixes (``reranker/prefix.py``) the bounds are segments (a prefix, or a pair's suffix) and
    ``prefixes[i]`` is the ``(start, end)`` of the prefix segment ``i`` also attends to (None: none)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    prefixes: tuple[tuple[int, int] | None, ...] = ()

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.starts, self.ends))

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``cu_seqlens`` ([pairs + 1], int32) carrying the plan itself as an attribute.

        The plan travels to the attention function as this tensor rather than as a Python object so that a
        ``torch.compile``-d decoder layer sees an ordinary tensor input (no guard on the pair lengths, no
        recompilation per group); the attention reads the bounds from the attribute, without a device sync.
        """
        return self.attach(torch.tensor((0,) + self.ends, dtype=torch.int32, device=device))

    def attach(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``cu_seqlens`` (this plan's bounds, on any device) carrying the plan as an attribute."""
        setattr(cu_seqlens, _BOUNDS_ATTR, self)
        return cu_seqlens


def plan_of(cu_seqlens: torch.Tensor) -> PackPlan:
    plan = getattr(cu_seqlens, _BOUNDS_ATTR, None)
    if plan is None:  # a tensor built elsewhere: read it (one host sync)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        plan = PackPlan(tuple(bounds[:-1]), tuple(bounds[1:]))
    return plan


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@functools.cache
def _varlen_attention():
    """PyTorch's variable-length flash attention (``torch.nn.attention.varlen``) with its causal and grouped-query
    keywords for this torch release, or None where it is missing or takes no ``scale`` (its first release)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params:
        return None
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return functools.partial(varlen_attn, **causal), "enable_gqa" in params


@functools.cache
def _flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)  # flash attention kernels: Ampere and newer


def varlen_attention_ready(device: torch.device | str) -> bool:
    """Whether scoring on ``device`` runs the packed pairs' attention as one variable-length flash call per layer:
    a CUDA GPU of compute capability 8.0 or newer with flash SDPA allowed, and a torch that has the kernel."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled() and _varlen_attention() is not None
            and _flash_capable(device.index if device.index is not None else torch.cuda.current_device()))


def _varlen_ready(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """One variable-length attention call for all the pairs: see :func:`varlen_attention_ready`, in half precision,
    without gradients (scoring) and without a sliding window. Training keeps one SDPA call per pair."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not torch.is_grad_enabled()
            and kwargs.get("sliding_window") is None and varlen_attention_ready(query.device))


@torch.compiler.disable  # a graph break around attention: the loop over pairs is not traced into a compiled layer
def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA per pair when the forward carries a :class:`PackPlan`, plain SDPA otherwise.

    The plan comes as ``cu_seqlens`` (see :meth:`PackPlan.as_tensor`). ``query`` is [1, heads, T, head_dim]
    for a packed sequence; the output is [1, T, heads, head_dim], as transformers' SDPA function returns it.
    """
    cu_seqlens: torch.Tensor | None = kwargs.pop(PLAN_KWARG, None)
    sdpa = _sdpa()
    if cu_seqlens is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    plan = plan_of(cu_seqlens)
    if attention_mask is not None:
        raise ValueError("a packed forward must not carry an attention mask (pairs are separated by the plan)")
    if plan.prefixes:
        return _shared_prefix_attention(module, query, key, value, cu_seqlens, plan, kwargs)
    if len(plan.starts) == 1:
        return sdpa(module, query, key, value, None, is_causal=True, **kwargs)
    if cu_seqlens.is_cuda and _varlen_ready(query, kwargs):
        # one kernel for every pair of the sequence instead of one SDPA call (and three slices) per pair: the
        # thread that launches the model's work issues ~30 calls a forward instead of ~30 x pairs
        varlen, gqa_keyword = _varlen_attention()
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, head_dim]
        longest = max(plan.lengths)
        extra = {"enable_gqa": True} if gqa_keyword and k.shape[1] != q.shape[1] else {}
        out = varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scale=kwargs.get("scaling"), **extra)
        return out.unsqueeze(0), None
    outputs = []
    for start, end in zip(plan.starts, plan.ends):
        out, _ = sdpa(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                      is_causal=True, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def _shared_prefix_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             cu_seqlens: torch.Tensor, plan: PackPlan,
                             kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """Attention of a packed sequence with shared prefixes (``reranker/prefix.py``): a prefix segment causal on
    itself, a suffix on [its prefix + itself], lower-right causal."""
    from .prefix import suffix_mask

    sdpa = _sdpa()
    keys = getattr(cu_seqlens, _KEYS_ATTR, None)
    if keys is not None and cu_seqlens.is_cuda and _varlen_ready(query, kwargs):
        # flash attention's causal mask is aligned to the bottom right where a segment has fewer queries than
        # keys: each suffix token sees the whole prefix and the suffix up to itself
        varlen, gqa_keyword = _varlen_attention()
        key_rows, cu_keys, longest_key = keys
        q = query[0].transpose(0, 1).contiguous()
        k, v = (t[0].index_select(1, key_rows).transpose(0, 1).contiguous() for t in (key, value))
        extra = {"enable_gqa": True} if gqa_keyword and k.shape[1] != q.shape[1] else {}
        out = varlen(q, k, v, cu_seqlens, cu_keys, max(plan.lengths), longest_key, scale=kwargs.get("scaling"),
                     **extra)
        return out.unsqueeze(0), None
    outputs = []
    for start, end, prefix in zip(plan.starts, plan.ends, plan.prefixes):
        if prefix is None:
            out, _ = sdpa(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                          is_causal=True, **kwargs)
        else:
            k, v = (torch.cat((t[:, :, prefix[0] : prefix[1]], t[:, :, start:end]), dim=2) for t in (key, value))
            mask = suffix_mask(end - start, prefix[1] - prefix[0], query.device)
            out, _ = sdpa(module, query[:, :, start:end], k, v, mask, is_causal=False, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def register_packed_attention() -> None:
    """Make :data:`PACKED_ATTENTION` known to transformers (idempotent). For mask building it behaves as SDPA,
    so a padded batch sent to a model switched to it still gets its padding mask."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    _REGISTERED = True


def _text_configs(model: nn.Module) -> list[Any]:
    from .families import family_of_model

    configs = []
    for module in family_of_model(model).language_models(model):
        if all(module.config is not c for c in configs):
            configs.append(module.config)
    return configs


def enable_packed_attention(model: nn.Module) -> int:
    """Switch the language model(s) inside ``model`` to :data:`PACKED_ATTENTION` (the vision tower keeps its
    own), and a DeepStack language model (Qwen3-VL's) to :func:`_deepstack_at_rows`. Returns how many text configs
    were switched. Needs SDPA or the packed function already."""
    from .families import family_of_model

    register_packed_attention()
    configs = _text_configs(model)
    for config in configs:
        current = config._attn_implementation
        if current not in ("sdpa", PACKED_ATTENTION):
            raise ValueError(f"packing pairs needs attn_implementation 'sdpa' for the language model, got {current!r} "
                             "(set model.attn_implementation: sdpa, or model.pack_pairs: false)")
        config._attn_implementation = PACKED_ATTENTION
    for language_model in family_of_model(model).language_models(model):
        if hasattr(language_model, "_deepstack_process"):
            language_model._deepstack_process = types.MethodType(_deepstack_at_rows, language_model)
    return len(configs)


def _deepstack_at_rows(language_model: nn.Module, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor,
                       visual_embeds: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's DeepStack add with the image rows of a packed batch given as indices (built on the host by
    :func:`pack_batch`): the stock add gathers by a boolean mask, which reads the mask back from the device at
    each of the first decoder layers. The same sums (one add per image row); a mask still takes the stock add."""
    if visual_pos_masks.dtype == torch.bool:
        return type(language_model)._deepstack_process(language_model, hidden_states, visual_pos_masks,
                                                       visual_embeds)
    rows, embeds = visual_pos_masks, visual_embeds.to(hidden_states.dtype).unsqueeze(0)
    return hidden_states.index_copy(1, rows, hidden_states.index_select(1, rows) + embeds)


def _mm_token_types(vl_model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Text 0, image 1, video 2 — what the processor's ``mm_token_type_ids`` holds, from the token ids."""
    config = vl_model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def pack_inputs(vl_model: nn.Module, batch: dict[str, Any]) -> tuple[dict[str, Any], PackPlan, torch.Tensor]:
    """Model inputs for one packed sequence from a padded batch (either padding side).

    ``vl_model`` is the ``Qwen2_5_VLModel`` (for ``get_rope_index``). Returns the inputs (batch 1, position
    ids [4, 1, T]: transformers' packed layout, row 0 the text positions restarting per pair, rows 1-3 the
    mRoPE positions), the :class:`PackPlan`, and the index of every pair's last token in the packed sequence.
    """
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    keep = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    lengths = keep.sum(dim=1)
    lengths_host = [int(n) for n in lengths.tolist()]  # the one host sync of the packing
    if min(lengths_host) <= 0:
        raise ValueError("every pair needs at least one real token to be packed")

    token_types = batch.get("mm_token_type_ids")
    if token_types is None:
        token_types = _mm_token_types(vl_model, input_ids)
    image_grid = batch.get("image_grid_thw")
    video_grid = batch.get("video_grid_thw")
    text_positions = (keep.long().cumsum(dim=1) - 1)[keep]  # 0 .. len-1 per pair, whatever the padding side
    if image_grid is not None or video_grid is not None:
        rope_kwargs = {"image_grid_thw": image_grid, "video_grid_thw": video_grid, "attention_mask": keep.long()}
        if batch.get("second_per_grid_ts") is not None:
            rope_kwargs["second_per_grid_ts"] = batch["second_per_grid_ts"]
        positions, _ = vl_model.get_rope_index(input_ids, mm_token_type_ids=token_types, **rope_kwargs)
        mrope = positions[:, keep]  # [3, T]: the padded path's positions of the real tokens, rows in order
    else:
        mrope = text_positions.unsqueeze(0).expand(3, -1)
    position_ids = torch.cat([text_positions.unsqueeze(0), mrope.to(text_positions.dtype)], dim=0).unsqueeze(1)

    ends = torch.tensor(lengths_host).cumsum(0)
    plan = PackPlan(tuple((ends - torch.tensor(lengths_host)).tolist()), tuple(ends.tolist()))
    inputs = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    inputs["input_ids"] = input_ids[keep].unsqueeze(0)
    inputs["mm_token_type_ids"] = token_types[keep].unsqueeze(0)
    inputs["position_ids"] = position_ids
    last_index = (ends - 1).to(input_ids.device)
    return inputs, plan, last_index


@dataclass(frozen=True)
class PackedBatch:
    """One packed forward's inputs with everything that depends only on the inputs' shapes already worked out:
    the packed token ids and mRoPE positions, where each pair ends, where the image tokens go, and the vision
    tower's grid-derived inputs. Built on the host by :func:`pack_batch` (a scoring thread, before the batch is
    copied to the device), so the forward reads nothing back from the device. :meth:`to` moves what the kernels
    read; the plan, the grids and the vision tower's segment bounds stay on the host."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [3, 1, T]: mRoPE (temporal, height, width)
    last_index: torch.Tensor  # [pairs]: every pair's last token in the packed sequence
    plan: PackPlan
    cu_seqlens: torch.Tensor  # [pairs + 1] int32: the plan's bounds, for a variable-length attention kernel
    pixel_values: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None  # [image tokens]: where the image features go in the sequence
    image_grid_thw: torch.Tensor | None = None  # stays on the host
    vision_to_device: dict[str, Any] = field(default_factory=dict)
    vision_on_host: dict[str, Any] = field(default_factory=dict)
    key_rows: torch.Tensor | None = None  # shared prefixes: the rows each segment's keys are gathered from
    cu_seqlens_k: torch.Tensor | None = None  # ... their bounds (int32)
    longest_key: int = 0
    image_keys: tuple[bytes, ...] | None = None  # the vision feature cache's key of each image (vision_cache.py)

    def _map(self, fn) -> PackedBatch:
        from .families.segments import map_segment_rows

        moved = {name: fn(getattr(self, name)) if getattr(self, name) is not None else None
                 for name in ("input_ids", "position_ids", "last_index", "cu_seqlens", "pixel_values", "image_rows",
                              "key_rows", "cu_seqlens_k")}
        return replace(self, **moved, vision_to_device={k: fn(v) for k, v in self.vision_to_device.items()},
                       vision_on_host=map_segment_rows(self.vision_on_host, fn))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        return self._map(lambda t: t.pin_memory())

    @property
    def pairs(self) -> int:
        return len(self.last_index)

    @property
    def tokens(self) -> int:
        """Tokens the language model runs on (with shared prefixes, each prefix counted once)."""
        return int(self.input_ids.shape[1])

    def attention_bounds(self) -> torch.Tensor:
        """``cu_seqlens`` carrying the plan (and, with shared prefixes, the key rows) for the attention."""
        bounds = self.plan.attach(self.cu_seqlens)
        if self.key_rows is not None:
            setattr(bounds, _KEYS_ATTR, (self.key_rows, self.cu_seqlens_k, self.longest_key))
        return bounds


def pack_batch(vl_model: nn.Module, batch: dict[str, Any], share_prefixes: bool = False,
               keyed_images: bool = False) -> PackedBatch:
    """The :class:`PackedBatch` of a padded batch (processor outputs). Works on the host: a batch already on
    the device is read back here (its token ids, mask, token types and grids; the first read waits for the
    device), the pixels stay where they are (host pixels are cast to the vision tower's dtype). ``vl_model`` is the
    ``Qwen2_5_VLModel`` (its config, ``get_rope_index`` and the tower's dtype); its family computes the vision
    tower's grid-derived inputs. ``share_prefixes``: pairs that begin alike share one prefix segment
    (``reranker/prefix.py``; needs host pixels). ``keyed_images``: each image's key for the vision feature cache
    (``reranker/vision_cache.py``), hashed from host pixels (a batch whose pixels are on the device gets none)."""
    from .families import family_of_model

    if batch.get("pixel_values_videos") is not None or batch.get("video_grid_thw") is not None:
        raise ValueError("packing pairs does not take videos; set model.pack_pairs: false to score them")
    host = {k: v.cpu() if isinstance(v, torch.Tensor) and k != "pixel_values" else v for k, v in batch.items()}
    inputs, plan, last_index = pack_inputs(vl_model, host)
    grid = host.get("image_grid_thw")
    pixels = batch.get("pixel_values")
    if pixels is not None and pixels.device.type == "cpu":
        # the tower's first step casts them to its dtype; done here, the copy to the device is half the bytes
        # (float32 pixels of 32 images at the default pixel budget are ~770 MB) and the scores are the same
        pixels = pixels.to(vl_model.visual.dtype)
    input_ids, position_ids = inputs["input_ids"], inputs["position_ids"][1:]
    extra: dict[str, Any] = {}  # the shared prefixes' key gather, the image keys
    if share_prefixes:
        input_ids, position_ids, plan, last_index, pixels, grid, extra = _with_shared_prefixes(
            vl_model, input_ids, position_ids, plan, pixels, grid)
    vision_to_device, vision_on_host, image_rows = {}, {}, None
    if pixels is not None:
        image_rows = (input_ids[0] == vl_model.config.image_token_id).nonzero().squeeze(1)
        vision_to_device, vision_on_host = family_of_model(vl_model).vision_inputs_on_host(
            vl_model.config.vision_config, grid)
        if keyed_images and pixels.device.type == "cpu":
            extra["image_keys"] = image_keys(pixels, grid)
    # the text row of the positions is dropped on purpose: with row 0 present, transformers would also build a
    # dense packed T×T mask; the plan separates the pairs instead
    return PackedBatch(input_ids, position_ids, last_index, plan, plan.as_tensor(), pixels,
                       image_rows, grid if pixels is not None else None, vision_to_device, vision_on_host, **extra)


def _with_shared_prefixes(vl_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: PackPlan,
                          pixels: torch.Tensor | None, grid: torch.Tensor | None) -> tuple:
    """The packed ids, positions, plan, last indices, pixels, grid and key gather with each group's shared prefix
    kept once (``reranker/prefix.py``); the positions are the unshared pairs' own, so scores do not change."""
    from .prefix import key_gather, locate_images, prefix_groups, shared_layout

    if pixels is not None and pixels.device.type != "cpu":
        raise ValueError("sharing prefixes compares the pixels on the host: pass host pixels")
    merge = vl_model.config.vision_config.spatial_merge_size
    images = locate_images(input_ids[0], plan.starts, vl_model.config.image_token_id, grid, merge)
    groups = prefix_groups(input_ids[0], plan.starts, plan.lengths, images, grid, pixels)
    if all(len(members) == 1 for members, _ in groups):  # nothing shared: the plain packing
        return input_ids, position_ids, plan, torch.tensor(plan.ends) - 1, pixels, grid, {}
    layout = shared_layout(groups, plan.starts, plan.ends, images)
    if pixels is not None:
        rows = [torch.arange(*images.pixel_rows[k]) for k in layout.kept_images]
        pixels = pixels.index_select(0, torch.cat(rows)) if rows else None
        grid = grid[layout.kept_images] if rows else None
    shared = PackPlan(layout.starts, layout.ends, layout.prefixes)
    key_rows, cu_keys, longest = key_gather(layout.starts, layout.ends, layout.prefixes)
    return (input_ids[:, layout.keep_rows], position_ids[:, :, layout.keep_rows], shared, layout.last_index, pixels,
            grid, {"key_rows": key_rows, "cu_seqlens_k": cu_keys, "longest_key": longest})


def packed_last_hidden(vl_model: nn.Module, batch: dict[str, Any] | PackedBatch,
                       vision_cache: VisionFeatureCache | None = None) -> torch.Tensor:
    """[N, hidden]: the last hidden state at every pair's last token, from one packed forward of
    ``vl_model`` (a ``Qwen2_5_VLModel`` whose language model uses :data:`PACKED_ATTENTION`).

    ``batch``: a :class:`PackedBatch` on the model's device (nothing is read back from the device), or a padded
    batch, packed here by :func:`pack_batch`. The image features go into the sequence at the rows the plan
    knows (no count check on the device), and the language model runs on the embeddings. ``vision_cache``: images
    of a batch with keys (``pack_batch(keyed_images=True)``) already seen take their features from it
    (``reranker/vision_cache.py``); the others run through the tower and are kept."""
    if any(c._attn_implementation != PACKED_ATTENTION for c in _text_configs(vl_model)):
        raise RuntimeError("the language model is not switched to packed attention: call enable_packed_attention")
    embedding = vl_model.get_input_embeddings()
    packed = batch if isinstance(batch, PackedBatch) else pack_batch(vl_model, batch).to(embedding.weight.device)
    embeds = embedding(packed.input_ids)
    deepstack: dict[str, Any] = {}
    if packed.pixel_values is not None:
        if vision_cache is not None and packed.image_keys is not None:
            features = cached_tower_features(vl_model, packed, vision_cache)
        else:
            per_image = tower_features(vl_model, packed.pixel_values, packed.image_grid_thw,
                                       {**packed.vision_to_device, **packed.vision_on_host})
            features = ImageFeatures(torch.cat([f.embeds for f in per_image]),
                                     tuple(torch.cat(layer) for layer in zip(*(f.deepstack for f in per_image))))
        embeds = embeds.index_copy(1, packed.image_rows, features.embeds.to(embeds.dtype).unsqueeze(0))
        deepstack = _deepstack_inputs(features.deepstack, packed.image_rows, embeds)
    outputs = vl_model.language_model(inputs_embeds=embeds, position_ids=packed.position_ids, use_cache=False,
                                      return_dict=True, **deepstack, **{PLAN_KWARG: packed.attention_bounds()})
    return outputs.last_hidden_state[0].index_select(0, packed.last_index)


def _deepstack_inputs(layers: tuple[torch.Tensor, ...], image_rows: torch.Tensor, embeds: torch.Tensor
                      ) -> dict[str, Any]:
    """Qwen3-VL's DeepStack: features of intermediate vision layers (one tensor per layer, every image's rows in
    sequence order) that its language model adds at the image rows after each of its first decoder layers
    (``visual_pos_masks``, ``deepstack_visual_embeds``); {} for a tower without them (Qwen2.5-VL). The language
    model adds them in the order of ``image_rows`` (ascending, one row per image token, images in sequence order)."""
    if not layers:
        return {}
    return {"visual_pos_masks": image_rows,  # row indices, not the stock boolean mask (:func:`_deepstack_at_rows`)
            "deepstack_visual_embeds": [layer.to(embeds.dtype) for layer in layers]}
