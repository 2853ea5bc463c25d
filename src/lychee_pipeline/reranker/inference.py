"""Scoring API: ``Reranker.score(query, docs)`` -> p(yes) per document, ``rerank`` -> best first.

Pairs are measured in chunks (token counts from the text and the image headers), sorted by token length
inside each chunk and batched, so batches carry little padding; results come back in input order. A host
thread decodes, tokenizes and encodes the next batches (bounded queue) while the model runs on the current
one. Runs under ``torch.inference_mode``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PairCollator
from .model import LycheeReranker, ModelConfig, load_reranker, processing_of, read_metadata
from .processing import ProcessingConfig
from .prompt import instruction_for

log = logging.getLogger(__name__)

Item = Mapping[str, Any]


class Reranker:
    """Inference wrapper around a :class:`LycheeReranker`.

    ``Reranker(model)`` wraps a loaded model (for example the one being trained);
    ``Reranker.from_pretrained(...)`` loads one frozen for inference.
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
    ):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model = model
        self.batch_size = int(batch_size)
        self.chunk_size = int(batch_size) * max(int(chunk_batches), 1)
        # batches prepared ahead by the host thread (0: prepare each batch in the calling thread, no overlap)
        self.prefetch_batches = max(int(prefetch_batches), 0)
        self.collator = PairCollator(model.processor, max_length, min_pixels, max_pixels, instructions)
        self.processing = ProcessingConfig(max_length, min_pixels, max_pixels, instructions)

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
    ) -> Reranker:
        """Load a hub id, a local folder or ``builtin:tiny`` (+ an optional LoRA adapter folder).

        A folder saved by ``LycheeReranker.save_pretrained`` that holds only an adapter may be passed
        as ``name_or_path``: its base model is read from its metadata.

        ``max_length``, ``min_pixels``, ``max_pixels`` and ``instructions`` left as None are those the saved
        model was trained with (its metadata's processing settings), else the library defaults; a value
        given here overrides them.
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
        )
        model = load_reranker(cfg, device)
        model.eval()
        trained = processing_of(adapter) if adapter is not None else processing_of(name_or_path)
        settings = (trained or ProcessingConfig()).overridden(
            max_length=max_length, min_pixels=min_pixels, max_pixels=max_pixels, instructions=instructions)
        log.info("scoring with %s processing settings%s: %s", "the trained" if trained else "the default",
                 " (overridden by the caller)" if settings != (trained or ProcessingConfig()) else "",
                 settings.as_dict())
        return cls(model, batch_size, settings.max_length, settings.min_pixels, settings.max_pixels,
                   settings.instructions)

    # -- scoring ----------------------------------------------------------------------------------
    def batches(self, pairs: Sequence[Sequence[Any]]):
        """``(positions in pairs, host batch)`` in scoring order: chunks of ``chunk_size`` pairs sorted by token
        count (measured without decoding images), then cut into batches of ``batch_size``."""
        pin = self.model.device.type == "cuda"
        for start in range(0, len(pairs), self.chunk_size):
            # prompts rendered, tokens counted and truncation applied once; images decoded only per batch
            chunk = [self.collator.prepare(p, decode=False, count=True)
                     for p in pairs[start : start + self.chunk_size]]
            order = sorted(range(len(chunk)), key=lambda i: chunk[i][2])
            for b in range(0, len(order), self.batch_size):
                idx = order[b : b + self.batch_size]
                batch = self.collator.encode([self.collator.decode(chunk[i]) for i in idx])
                if pin:  # page-locked, so the copy to the GPU is asynchronous
                    batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                yield [start + i for i in idx], batch

    def _prefetched(self, pairs: Sequence[Sequence[Any]]):
        """:meth:`batches` produced by one host thread, at most ``prefetch_batches`` ahead (one thread: the
        tokenizer and the collator's counters are not shared between threads)."""
        if self.prefetch_batches == 0:
            yield from self.batches(pairs)
            return
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch_batches)
        stop = threading.Event()
        done = object()

        def produce() -> None:
            try:
                for item in self.batches(pairs):
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                item = done
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                item = exc
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        worker = threading.Thread(target=produce, name="lychee-score-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            worker.join(timeout=30)

    def score_pairs(self, pairs: Sequence[Sequence[Any]], task_types: Sequence[str | None] | None = None) -> list[float]:
        """p(yes) for each ``(query, doc)`` or ``(query, doc, instruction)`` pair, in input order.

        ``task_types`` (optional, one per pair): the task type whose instruction a pair gets, as training
        gives every document of a record its record's ``task_type``; pass the records' task types to score as
        trained. Without one (or for None), the instruction follows the pair's own modalities.

        Pairs are sorted by length within chunks (little padding). A host thread prepares the next batches
        (image decoding, tokenization, the processor) while the model runs; each batch's scores are read back
        after the next batch has been launched, so the device always has queued work.
        """
        if task_types is not None:
            if len(task_types) != len(pairs):
                raise ValueError(f"{len(task_types)} task types for {len(pairs)} pairs")
            pairs = [pair if len(pair) == 3 or task is None
                     else (pair[0], pair[1], instruction_for(task, self.collator.instructions))
                     for pair, task in zip(pairs, task_types)]
        scores: list[float] = [0.0] * len(pairs)
        was_training = self.model.training
        self.model.eval()
        device = self.model.device
        pending: tuple[list[int], torch.Tensor] | None = None

        def read_back() -> None:
            positions, probs = pending
            for i, p in zip(positions, probs.float().cpu().tolist()):
                scores[i] = float(p)

        try:
            with torch.inference_mode():
                for positions, batch in self._prefetched(pairs):
                    batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                             for k, v in batch.items()}
                    probs = self.model.probabilities(self.model(**batch))
                    if pending is not None:
                        read_back()
                    pending = (positions, probs)
                if pending is not None:
                    read_back()
        finally:
            self.model.train(was_training)
        return scores

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
