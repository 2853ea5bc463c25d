"""Prefix reuse in packed scoring: a query's shared prefix runs through the language model once per batch.

Every candidate of a query repeats the same prompt prefix: system prompt, instruction, the query's text and
image. With ``Reranker(..., prefix_reuse=True)`` the host finds, inside each packed batch, pairs whose leading
tokens are the same (token ids equal, and every image inside that span has the same grid and the same pixels)
and lays them out as one *prefix segment* followed by each pair's *suffix segment*:

    [prefix] [suffix of pair 1] [suffix of pair 2] ...

The prefix segment attends causally to itself; each suffix attends to the whole prefix and causally to itself
(lower-right causal over [prefix + suffix]): what each of its tokens saw in the unshared sequence, since the
prefix's hidden states do not depend on what follows them. The mRoPE positions of every token are those the
unshared pair had (computed for the full pairs first, then the repeated prefix tokens dropped), so a suffix's
positions continue from the prefix's end exactly as before, and the scores are the plain path's. The query's
image goes through the vision tower once too.

On CUDA (half precision, no gradients) the attention is still one variable-length flash call per layer: the
query side is the packed sequence as it is, the key side gathers [prefix + suffix] per suffix segment (keys are
small with grouped-query attention: 4 of 28 heads), with flash attention's causal mask aligned to the
bottom right (its convention where queries are fewer than keys). Elsewhere one SDPA call per segment with a
boolean mask. Everything is worked out on the host, in the scorer's preparing thread (:func:`share_prefixes`).

Grouping: pairs are taken in batch order (the scorer sorts a chunk by prompt text when prefix reuse is on, so a
query's candidates are neighbours); a pair joins the current group when that saves tokens (its shared length
times the grown group beats the group's current saving), else it starts a new group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SHARED_TOKENS = 8  # below this a shared prefix is not worth a segment of its own


def resolve_prefix_reuse(choice: bool | str, refusal: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """A scorer's ``prefix_reuse``: ``True`` / ``False`` as given (``True`` where it cannot run is ``refusal`` as a
    one-line error), ``"auto"`` on where the packed batch's attention is one variable-length flash call per
    layer (the model takes prefix reuse: ``refusal`` is its ``prefix_reuse_refusal()``; half precision on a CUDA GPU
    with the kernel): there sharing a prefix only removes work, and the scores are the plain path's. Off elsewhere:
    a CPU, or fp32, attends one masked SDPA call per segment."""
    if isinstance(choice, bool):
        if choice and refusal is not None:
            raise ValueError(refusal)
        return choice
    if choice != "auto":
        raise ValueError(f"prefix_reuse must be auto, true or false, got {choice!r}")
    from .packing import varlen_attention_ready

    return refusal is None and dtype in (torch.float16, torch.bfloat16) and varlen_attention_ready(device)


@dataclass(frozen=True)
class PairImages:
    """Where the images of a packed batch are: per image its first and last token in the packed sequence and
    its rows of ``pixel_values``; per pair the indices of its images, in order."""

    first_token: list[int]
    last_token: list[int]
    pixel_rows: list[tuple[int, int]]
    of_pair: list[list[int]]


def locate_images(input_ids: torch.Tensor, starts: tuple[int, ...], image_token_id: int,
                  grid: torch.Tensor | None, merge: int) -> PairImages:
    """The :class:`PairImages` of packed ids ``input_ids`` [T] (host) whose pairs start at ``starts``."""
    of_pair: list[list[int]] = [[] for _ in starts]
    if grid is None or grid.numel() == 0:
        return PairImages([], [], [], of_pair)
    patches = grid.prod(dim=1).tolist()
    tokens = [p // (merge * merge) for p in patches]
    rows = (input_ids == image_token_id).nonzero().squeeze(1).tolist()
    if len(rows) != sum(tokens):
        raise ValueError(f"{len(rows)} image tokens in the batch for {sum(tokens)} image features")
    first, last, pixel_rows, at, row = [], [], [], 0, 0
    bounds = list(starts) + [len(input_ids)]
    pair = 0
    for k, (n, p) in enumerate(zip(tokens, patches)):
        first.append(rows[at])
        last.append(rows[at + n - 1])
        pixel_rows.append((row, row + p))
        while rows[at] >= bounds[pair + 1]:
            pair += 1
        of_pair[pair].append(k)
        at, row = at + n, row + p
    return PairImages(first, last, pixel_rows, of_pair)


def shared_length(ids: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...], a: int, b: int,
                  images: PairImages, grid: torch.Tensor | None, pixels: torch.Tensor | None) -> int:
    """How many leading tokens pairs ``a`` and ``b`` share: equal ids, never cutting through an image, every
    image inside with the same grid and pixels; at most one token less than the shorter pair (each pair keeps
    its last token, where it is scored)."""
    most = min(lengths[a], lengths[b]) - 1
    if most <= 0:
        return 0
    left, right = ids[starts[a] : starts[a] + most], ids[starts[b] : starts[b] + most]
    differ = (left != right).nonzero()
    shared = int(differ[0, 0]) if len(differ) else most
    for ka, kb in zip(images.of_pair[a], images.of_pair[b]):
        begin = images.first_token[ka] - starts[a]
        if begin >= shared:
            break
        end = images.last_token[ka] - starts[a]
        (ra, rb), (sa, sb) = images.pixel_rows[ka], images.pixel_rows[kb]
        same = (end < shared and torch.equal(grid[ka], grid[kb])
                and torch.equal(pixels[ra:rb], pixels[sa:sb]))
        if not same:
            return begin
    return shared


def prefix_groups(ids: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...], images: PairImages,
                  grid: torch.Tensor | None, pixels: torch.Tensor | None) -> list[tuple[list[int], int]]:
    """``(pairs, shared prefix length)`` groups in batch order (see the module's docstring); a group of one pair
    has length 0."""
    groups: list[tuple[list[int], int]] = []
    for pair in range(len(starts)):
        if groups:
            members, prefix = groups[-1]
            shared = shared_length(ids, starts, lengths, members[0], pair, images, grid, pixels)
            grown = min(prefix, shared) if len(members) > 1 else shared
            if grown >= MIN_SHARED_TOKENS and grown * len(members) > prefix * (len(members) - 1):
                groups[-1] = (members + [pair], grown)
                continue
        groups.append(([pair], 0))
    return groups


@dataclass(frozen=True)
class SharedLayout:
    """The packed batch with shared prefixes: which packed rows (of the unshared packing) are kept, the segments
    (``starts``/``ends`` in the new sequence, with the prefix segment each suffix also attends to), every pair's
    last token, and which images (of the unshared batch) remain."""

    keep_rows: torch.Tensor
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    prefixes: tuple[tuple[int, int] | None, ...]
    last_index: torch.Tensor
    kept_images: list[int]


def shared_layout(groups: list[tuple[list[int], int]], starts: tuple[int, ...], ends: tuple[int, ...],
                  images: PairImages) -> SharedLayout:
    """The :class:`SharedLayout` of ``groups`` over the unshared packing's pair bounds ``starts``/``ends``."""
    keep, seg_starts, seg_ends, prefixes, last, kept_images = [], [], [], [], [], []
    at = 0
    for members, prefix in groups:
        span = None
        if len(members) > 1:  # the prefix once, from the group's first pair
            lead = starts[members[0]]
            keep.append(torch.arange(lead, lead + prefix))
            seg_starts.append(at)
            seg_ends.append(at + prefix)
            prefixes.append(None)
            span = (at, at + prefix)
            at += prefix
            kept_images += [k for k in images.of_pair[members[0]] if images.first_token[k] < lead + prefix]
        for pair in members:
            skip = prefix if span is not None else 0
            keep.append(torch.arange(starts[pair] + skip, ends[pair]))
            seg_starts.append(at)
            at += ends[pair] - starts[pair] - skip
            seg_ends.append(at)
            prefixes.append(span)
            last.append(at - 1)
            kept_images += [k for k in images.of_pair[pair] if images.first_token[k] >= starts[pair] + skip]
    return SharedLayout(torch.cat(keep), tuple(seg_starts), tuple(seg_ends), tuple(prefixes),
                        torch.tensor(last), sorted(kept_images))


def key_gather(starts: tuple[int, ...], ends: tuple[int, ...],
               prefixes: tuple[tuple[int, int] | None, ...]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For one variable-length attention call: the packed rows each segment's keys are read from ([prefix +
    own rows] for a suffix, its own rows otherwise), their ``cu_seqlens`` (int32) and the longest."""
    rows, bounds, longest = [], [0], 0
    for start, end, prefix in zip(starts, ends, prefixes):
        if prefix is not None:
            rows.append(torch.arange(*prefix))
        rows.append(torch.arange(start, end))
        length = end - start + (prefix[1] - prefix[0] if prefix is not None else 0)
        bounds.append(bounds[-1] + length)
        longest = max(longest, length)
    return torch.cat(rows), torch.tensor(bounds, dtype=torch.int32), longest


def suffix_mask(suffix: int, prefix: int, device: torch.device) -> torch.Tensor:
    """[1, 1, suffix, prefix + suffix] boolean: the whole prefix, and causal within the suffix."""
    own = torch.ones(suffix, suffix, dtype=torch.bool, device=device).tril()
    seen = torch.ones(suffix, prefix, dtype=torch.bool, device=device)
    return torch.cat((seen, own), dim=1)[None, None]
