"""Scoring API: ``Reranker.score(query, docs)`` -> p(yes) per document, ``rerank`` -> best first.

The host prepares the batches (``reranker/preparation.py``: pairs measured in chunks, sorted by token length,
batched, decoded and encoded by host threads into a bounded queue while the model runs). This module is the
device loop: each batch's inputs are copied to the device (on a GPU, on a stream of their own, beside the
device's work on the batch before), the model scores them, and the scores come back to the host with one wait
at the end; results come back in input order. Runs under ``torch.inference_mode``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PairCollator
from .model import LycheeReranker, ModelConfig, load_reranker, processing_of, read_metadata
from .packing import PackedBatch
from .prefix import resolve_prefix_reuse
from .preparation import HostPreparation
from .processing import ProcessingConfig
from .prompt import instruction_for
from .vision_cache import VisionFeatureCache, cache_bytes

log = logging.getLogger(__name__)

Item = Mapping[str, Any]

IN_FLIGHT = 2  # batches launched on a GPU and not yet waited for


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A host batch (tensors, a :class:`PackedBatch`) on ``device``; copies from page-locked memory overlap."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, (torch.Tensor, PackedBatch)) else v
            for k, v in batch.items()}


class DeviceLaunches:
    """How batches reach the device and their scores come back, on a CPU: plain copies, nothing to wait for."""

    def __init__(self, device: torch.device):
        self.device = device

    def inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return to_device(batch, self.device)

    def scores(self, probs: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        return probs

    def finish(self) -> None:
        """Wait for the device's work (nothing to wait for here)."""


class GpuLaunches(DeviceLaunches):
    """On a GPU: each batch's inputs are copied on a stream of their own, beside the device's work on the batch
    before; its scores are copied to page-locked host memory without waiting; the host waits only to stay at most
    ``IN_FLIGHT`` batches ahead of the device, and once in :meth:`finish`.

    ``launched`` holds (event, device inputs) of the batches the device may still be working on: the inputs are
    held until their event, as they were copied on another stream, whose allocations could otherwise be reused
    early (so up to IN_FLIGHT + 1 batches' inputs are on the device; the pixels travel in the tower's dtype).
    """

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.copies = torch.cuda.Stream(device)
        self.launched: deque = deque()

    def inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        with torch.cuda.stream(self.copies):
            inputs = to_device(batch, self.device)
        torch.cuda.current_stream(self.device).wait_stream(self.copies)
        return inputs

    def scores(self, probs: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        host = torch.empty(probs.shape, dtype=probs.dtype, pin_memory=True)
        host.copy_(probs, non_blocking=True)  # lands when the device gets there
        self.launched.append((torch.cuda.Event(), inputs))
        self.launched[-1][0].record(torch.cuda.current_stream(self.device))
        if len(self.launched) > IN_FLIGHT:
            self.launched.popleft()[0].synchronize()  # the device still has the newer batches queued
        return host

    def finish(self) -> None:
        """The one wait for the last scores; after an error, the batch that failed is waited for too, before the
        inputs are let go."""
        try:
            torch.cuda.current_stream(self.device).synchronize()
        finally:
            self.launched.clear()


def launches_on(device: torch.device) -> DeviceLaunches:
    return GpuLaunches(device) if device.type == "cuda" else DeviceLaunches(device)


def with_task_instructions(pairs: Sequence[Sequence[Any]], task_types: Sequence[str | None] | None,
                           instructions: Mapping[str, str],
                           defaults: Mapping[str, str] | None = None) -> Sequence[Sequence[Any]]:
    """``pairs`` with the instruction of each pair's task type (a pair that has its own, or no task type, kept);
    ``defaults``: the model family's default instructions."""
    if task_types is None:
        return pairs
    if len(task_types) != len(pairs):
        raise ValueError(f"{len(task_types)} task types for {len(pairs)} pairs")
    return [pair if len(pair) == 3 or task is None else (pair[0], pair[1], instruction_for(task, instructions, defaults))
            for pair, task in zip(pairs, task_types)]


def in_input_order(results: list[tuple[list[int], torch.Tensor]], n: int) -> list[float]:
    """The scores of ``(positions, probabilities)`` batches, back in input order."""
    scores: list[float] = [0.0] * n
    for positions, probs in results:
        for i, p in zip(positions, probs.float().tolist()):
            scores[i] = float(p)
    return scores


class Reranker:
    """Inference wrapper around a :class:`LycheeReranker`.

    ``Reranker(model)`` wraps a loaded model (for example the one being trained);
    ``Reranker.from_pretrained(...)`` loads one frozen for inference. The host side is :attr:`preparation`
    (a :class:`~.preparation.HostPreparation`).
    """

    def __init__(
        self,
        model: LycheeReranker,
        batch_size: int = 32,
        max_length: int = DEFAULT_MAX_LENGTH,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        instructions: Mapping[str, str] | None = None,
        chunk_batches: int = 32,
        prefetch_batches: int = 2,
        prepare_workers: int | str = "auto",
        first_batch: int | str = "auto",
        prefix_reuse: bool | str = "auto",
        vision_cache_gib: float | str | None = "auto",
    ):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model = model
        collator = PairCollator(model.processor, max_length, min_pixels, max_pixels, instructions,
                                family=model.family.NAME)
        # prefetch_batches: batches prepared ahead by the host threads (0: prepare each batch in the calling
        # thread, no overlap).
        # prepare_workers: host threads preparing batches (auto: two where the packed attention is one
        # variable-length call per layer, else one). They contend for the GIL with the thread that launches the
        # model's kernels: with one attention call per pair and layer, on one H200 (7B, 800x800 JPEGs) 4 threads
        # gave 0.87 of the GPU-only rate, 2 gave 0.91 and one 0.95; with the variable-length call the launching
        # thread is light and 2 threads lifted a 128-pair call on mixed sizes from 0.83 to 0.91, 384 pairs
        # unchanged (16.07 against 16.02-16.08 pairs/s) (docs/benchmarks.md, 2026-12-03 and -04). Each extra
        # thread has its own processor.
        # first_batch: pairs of a first, smaller batch, so the device starts before a full batch is ready (auto: a
        # quarter batch on a GPU; 0 on a CPU, where the host and the model share the cores and nothing would
        # overlap).
        self.preparation = HostPreparation(model, collator, batch_size, chunk_batches, prefetch_batches,
                                           prepare_workers, first_batch)
        self.processing = ProcessingConfig(max_length, min_pixels, max_pixels, instructions)
        # prefix_reuse: a query's shared prompt prefix (system prompt, instruction, the query's text and image) runs
        # through the language model once per batch, each candidate attending to it (reranker/prefix.py); the
        # scores are the plain packed path's. Refused in one line for a model that does not pack pairs. auto: on where
        # the packed attention is one variable-length call per layer (a CUDA GPU; reranker/prefix.py says why).
        self.preparation.prefix_reuse = resolve_prefix_reuse(prefix_reuse, model.prefix_reuse_refusal(), model.device,
                                                             next(model.backbone.parameters()).dtype)
        # vision_cache_gib: the vision tower's features of the images already scored, kept on the device and reused
        # when an image comes again (the same document under many queries; reranker/vision_cache.py); the scores
        # are the uncached path's. auto: the smaller of 4 GiB and 5% of a GPU's memory (2 GiB on a CPU); 0: off.
        # Packed pairs only (the padded forward runs the tower as transformers does).
        budget = cache_bytes(vision_cache_gib, model.device)
        self.vision_cache = VisionFeatureCache(budget) if budget and model.config.pack_pairs else None
        self.preparation.keyed_images = self.vision_cache is not None

    @property
    def prefix_reuse(self) -> bool:
        return self.preparation.prefix_reuse

    @property
    def collator(self) -> PairCollator:
        """The collator holding the processing settings (the preparing threads' own collators follow it)."""
        return self.preparation.collator

    @property
    def batch_size(self) -> int:
        return self.preparation.batch_size

    # the preparing settings stay settable on the scorer between calls (they live on its preparation)
    prefetch_batches = property(lambda self: self.preparation.prefetch_batches,
                                lambda self, value: setattr(self.preparation, "prefetch_batches", value))
    prepare_workers = property(lambda self: self.preparation.prepare_workers,
                               lambda self, value: setattr(self.preparation, "prepare_workers", value))
    first_batch = property(lambda self: self.preparation.first_batch,
                           lambda self, value: setattr(self.preparation, "first_batch", value))

    @property
    def chunk_size(self) -> int:
        return self.preparation.chunk_size

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """See :meth:`HostPreparation.chunk_bounds`."""
        return self.preparation.chunk_bounds(n)

    def batches(self, pairs: Sequence[Sequence[Any]]):
        """``(positions in pairs, host batch)`` in scoring order, prepared in this thread
        (:meth:`HostPreparation.batches`)."""
        return self.preparation.batches(pairs)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        adapter: str | None = None,
        device: str | torch.device | None = "auto",
        batch_size: int = 32,
        max_length: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        instructions: Mapping[str, str] | None = None,
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        local_files_only: bool = False,
        tiny_cache_dir: str | None = None,
        prefix_reuse: bool | str = "auto",
        fp8: bool = False,
        vision_cache_gib: float | str | None = "auto",
    ) -> Reranker:
        """Load a hub id, a local folder or ``builtin:tiny`` (+ an optional LoRA adapter folder).

        A folder saved by ``LycheeReranker.save_pretrained`` that holds only an adapter may be passed
        as ``name_or_path``: its base model is read from its metadata.

        ``max_length``, ``min_pixels``, ``max_pixels`` and ``instructions`` left as None are those the saved
        model was trained with (its metadata's processing settings), else the library defaults; a value
        given here overrides them. ``prefix_reuse`` and ``vision_cache_gib``: see :class:`Reranker`; ``fp8``: ``ModelConfig.fp8`` (Hopper
        GPUs only, refused in one line elsewhere).
        """
        if adapter is None and Path(name_or_path).is_dir():
            meta = read_metadata(name_or_path)
            if meta and meta.get("format") == "adapter":
                adapter, name_or_path = name_or_path, meta["base_model"]
        cfg = ModelConfig(
            name_or_path=name_or_path,
            finetune="frozen",
            adapter=str(adapter) if adapter is not None else None,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=local_files_only,
            tiny_cache_dir=tiny_cache_dir,
            fp8=fp8,
        )
        model = load_reranker(cfg, device)
        model.eval()
        trained = processing_of(adapter) if adapter is not None else processing_of(name_or_path)
        untrained = ProcessingConfig(**model.family.PROCESSING_DEFAULTS)  # the published model's settings
        settings = (trained or untrained).overridden(
            max_length=max_length, min_pixels=min_pixels, max_pixels=max_pixels, instructions=instructions)
        source = "the model's trained" if trained else "the default (the model has none saved)"
        log.info("scoring with %s processing settings%s: %s", source,
                 ", with the caller's values for some" if settings != (trained or untrained) else "",
                 settings.as_dict())
        return cls(model, batch_size, settings.max_length, settings.min_pixels, settings.max_pixels,
                   settings.instructions, prefix_reuse=prefix_reuse, vision_cache_gib=vision_cache_gib)

    # -- scoring ----------------------------------------------------------------------------------
    def score_pairs(self, pairs: Sequence[Sequence[Any]], task_types: Sequence[str | None] | None = None) -> list[float]:
        """p(yes) for each ``(query, doc)`` or ``(query, doc, instruction)`` pair, in input order.

        ``task_types`` (optional, one per pair): the task type whose instruction a pair gets, as training
        gives every document of a record its record's ``task_type``; pass the records' task types to score as
        trained. Without one (or for None), the instruction follows the pair's own modalities.

        Pairs are sorted by length within chunks (little padding). Host threads prepare the next batches
        (image decoding, tokenization, the processor) while the model runs. On a GPU each batch's inputs are
        copied to the device on a stream of their own, beside the device's work on the batch before, and its
        scores are copied to page-locked host memory without waiting; the host waits only to stay at most
        ``IN_FLIGHT`` batches ahead of the device (its inputs hold device memory) and once at the end.
        """
        pairs = with_task_instructions(pairs, task_types, self.collator.instructions,
                                       self.collator.family_module.DEFAULT_INSTRUCTIONS)
        was_training = self.model.training
        self.model.eval()
        launches = launches_on(self.model.device)
        results: list[tuple[list[int], torch.Tensor]] = []
        try:
            with torch.inference_mode():
                for positions, batch in self.preparation.prefetched(pairs):
                    inputs = launches.inputs(batch)
                    probs = self.model.probabilities(self.model(**inputs, vision_cache=self.vision_cache))
                    results.append((positions, launches.scores(probs, inputs)))
        finally:
            try:
                launches.finish()
            finally:
                self.model.train(was_training)
        return in_input_order(results, len(pairs))

    def score(self, query: Item, docs: Sequence[Item], instruction: str | None = None) -> list[float]:
        """p(yes) of each document for ``query`` (text-only, image-only and mixed documents may mix)."""
        if instruction is None:
            return self.score_pairs([(query, d) for d in docs])
        return self.score_pairs([(query, d, instruction) for d in docs])

    def rerank(
        self, query: Item, docs: Sequence[Item], top_k: int | None = None, instruction: str | None = None
    ) -> list[tuple[int, float]]:
        """``(index into docs, p(yes))`` best first, the first ``top_k`` (all when None); ties keep input order."""
        scores = self.score(query, docs, instruction)
        ranked = sorted(enumerate(scores), key=lambda t: -t[1])
        return ranked if top_k is None else ranked[: int(top_k)]
