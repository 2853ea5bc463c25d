"""Scoring API: ``Reranker.score(query, docs)`` -> p(yes) per document, ``rerank`` -> best first.

Pairs are measured in chunks (token counts from the text and the image headers), sorted by token length
inside each chunk and batched, so batches carry little padding; results come back in input order. Host
threads measure, decode, tokenize and encode the next batches (bounded queue) while the model runs on the
current one; on a GPU a small first batch starts the device early, and scores come back to the host with one
wait at the end. Runs under ``torch.inference_mode``.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..host import cpus_available
from .collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PairCollator
from .model import LycheeReranker, ModelConfig, load_reranker, processing_of, read_metadata
from .packing import PackedBatch, varlen_attention_ready
from .processing import ProcessingConfig
from .prompt import instruction_for

log = logging.getLogger(__name__)

Item = Mapping[str, Any]

IN_FLIGHT = 2  # batches launched on a GPU and not yet waited for


def auto_preparing_threads(device_type: str, varlen_attention: bool, cpus: int) -> int:
    """``prepare_workers: auto``: two host threads where the launching thread is light (CUDA, the packed pairs'
    attention one variable-length call per layer) and the CPUs are there, else one (see ``Reranker.__init__``)."""
    return 2 if device_type == "cuda" and varlen_attention and cpus >= 4 else 1


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A host batch (tensors, a :class:`PackedBatch`) on ``device``; copies from page-locked memory overlap."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, (torch.Tensor, PackedBatch)) else v
            for k, v in batch.items()}


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
        prepare_workers: int | str = "auto",
        first_batch: int | str = "auto",
    ):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model = model
        self.batch_size = int(batch_size)
        self.chunk_size = int(batch_size) * max(int(chunk_batches), 1)
        # batches prepared ahead by the host thread (0: prepare each batch in the calling thread, no overlap)
        self.prefetch_batches = max(int(prefetch_batches), 0)
        # host threads preparing batches (auto: two where the packed attention is one variable-length call per
        # layer, else one). They contend for the GIL with the thread that launches the model's kernels: with one
        # attention call per pair and layer, on one H200 (7B, 800x800 JPEGs) 4 threads gave 0.87 of the GPU-only
        # rate, 2 gave 0.91 and one 0.95; with the variable-length call the launching thread is light and 2
        # threads lifted a 128-pair call on mixed sizes from 0.83 to 0.91, 384 pairs unchanged (16.07 against
        # 16.02-16.08 pairs/s) (docs/benchmarks.md, 2026-12-03 and -04). Each extra thread has its own processor
        self.prepare_workers = prepare_workers
        # pairs of a first, smaller batch, so the device starts before a full batch is ready (auto: a quarter
        # batch on a GPU; 0 on a CPU, where the host and the model share the cores and nothing would overlap)
        self.first_batch = first_batch
        self.collator = PairCollator(model.processor, max_length, min_pixels, max_pixels, instructions)
        self.processing = ProcessingConfig(max_length, min_pixels, max_pixels, instructions)
        self._clones: list[PairCollator] = []  # the extra threads' collators, made once and reused

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
        source = "the model's trained" if trained else "the default (the model has none saved)"
        log.info("scoring with %s processing settings%s: %s", source,
                 ", with the caller's values for some" if settings != (trained or ProcessingConfig()) else "",
                 settings.as_dict())
        return cls(model, batch_size, settings.max_length, settings.min_pixels, settings.max_pixels,
                   settings.instructions)

    # -- scoring ----------------------------------------------------------------------------------
    def _workers(self) -> int:
        if self.prepare_workers != "auto":
            return max(int(self.prepare_workers), 1)
        device = self.model.device
        return auto_preparing_threads(device.type, self.model.config.pack_pairs and varlen_attention_ready(device),
                                      cpus_available())

    def _first_batch(self) -> int:
        if self.first_batch == "auto":
            return max(1, self.batch_size // 4) if self.model.device.type == "cuda" and self.batch_size > 1 else 0
        return min(max(int(self.first_batch), 0), self.batch_size)

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """``(start, end)`` of the chunks sorted and batched together. With a first batch of F pairs (more
        than one batch of input only): F, 2F, 4F ... pairs while less than a batch, then chunks of 1, 2, 4 ...
        batches up to ``chunk_size``, so each chunk's device time covers the host's preparing of the next (the
        host prepares a pair in less time than the device scores it); else chunks of ``chunk_size``."""
        first = self._first_batch()
        if not first or n <= self.batch_size:
            return [(s, min(n, s + self.chunk_size)) for s in range(0, n, self.chunk_size)]
        bounds, start, size = [], 0, first
        while size < self.batch_size and start < n:
            bounds.append((start, min(n, start + size)))
            start, size = start + size, 2 * size
        size = self.batch_size
        while start < n:
            bounds.append((start, min(n, start + size)))
            start += size
            size = min(2 * size, self.chunk_size)
        return bounds

    def _batch_order(self, chunk: list[tuple[str, list[Any], int]]) -> list[list[int]]:
        order = sorted(range(len(chunk)), key=lambda i: chunk[i][2])
        return [order[b : b + self.batch_size] for b in range(0, len(order), self.batch_size)]

    def _encode(self, collator: PairCollator, prepared: list[tuple[str, list[Any], int]]) -> dict[str, Any]:
        # the packed sequence and the grid-derived inputs are worked out here too, off the launching thread
        batch = self.model.host_inputs(collator.encode([collator.decode(p) for p in prepared]))
        if self.model.device.type == "cuda":  # page-locked, so the copy to the GPU is asynchronous
            batch = {k: v.pin_memory() if isinstance(v, (torch.Tensor, PackedBatch)) else v for k, v in batch.items()}
        return batch

    def batches(self, pairs: Sequence[Sequence[Any]]):
        """``(positions in pairs, host batch)`` in scoring order: chunks (:meth:`chunk_bounds`) sorted by token
        count (measured without decoding images), then cut into batches of ``batch_size``; in this thread. A host
        batch is what the model's forward takes (``LycheeReranker.host_inputs``: a packed model's
        ``{"packed": PackedBatch}``), page-locked on a GPU."""
        for start, end in self.chunk_bounds(len(pairs)):
            # prompts rendered, tokens counted and truncation applied once; images decoded only per batch
            chunk = [self.collator.prepare(p, decode=False, count=True) for p in pairs[start:end]]
            for idx in self._batch_order(chunk):
                yield [start + i for i in idx], self._encode(self.collator, [chunk[i] for i in idx])

    def _worker_collators(self, count: int) -> list[PairCollator]:
        """``count`` collators with this scorer's settings, each with its own copy of the processor."""
        while len(self._clones) < count:
            self._clones.append(PairCollator(copy.deepcopy(self.model.processor), self.collator.max_length,
                                             self.collator.min_pixels, self.collator.max_pixels))
        for clone in self._clones[:count]:  # follow changes made to the main collator (set_max_pixels ...)
            clone.max_length, clone.min_pixels = self.collator.max_length, self.collator.min_pixels
            clone.max_pixels, clone.instructions = self.collator.max_pixels, self.collator.instructions
        return self._clones[:count]

    def _prefetched(self, pairs: Sequence[Sequence[Any]]):
        """The batches of :meth:`batches`, in the same order and composition, prepared ahead by host threads:
        at most ``prefetch_batches`` ready and waiting. One thread: :meth:`batches` in a producer thread.
        Several: the producer hands the measuring of each chunk (in slices) and the encoding of each batch to a
        pool whose threads each use their own collator; the next chunk is measured while this one is scored."""
        if self.prefetch_batches == 0:
            yield from self.batches(pairs)
            return
        workers = self._workers()
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch_batches)
        stop = threading.Event()
        done = object()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        pool = clones = None
        if workers > 1:
            clones = self._worker_collators(workers)
            free: queue.SimpleQueue = queue.SimpleQueue()
            for clone in clones:
                free.put(clone)
            pool = ThreadPoolExecutor(workers, thread_name_prefix="lychee-score-prepare")

            def with_collator(fn, *args):
                collator = free.get()
                try:
                    return fn(collator, *args)
                finally:
                    free.put(collator)

            def measure(collator, part):
                return [collator.prepare(p, decode=False, count=True) for p in part]

            def measuring(start: int, end: int) -> list:
                step = max(1, -(-(end - start) // (2 * workers)))  # two slices per thread: even finish times
                return [pool.submit(with_collator, measure, pairs[s : min(end, s + step)])
                        for s in range(start, end, step)]

        def produce() -> None:
            try:
                if pool is None:
                    for item in self.batches(pairs):
                        if not put(item):
                            return
                else:
                    bounds = self.chunk_bounds(len(pairs))
                    measured = measuring(*bounds[0]) if bounds else []
                    for k, (start, _) in enumerate(bounds):
                        chunk = [prepared for part in measured for prepared in part.result()]
                        for j, idx in enumerate(self._batch_order(chunk)):
                            encoded = pool.submit(with_collator, self._encode, [chunk[i] for i in idx])
                            if j == 0 and k + 1 < len(bounds):  # behind this chunk's first batch, not before it
                                measured = measuring(*bounds[k + 1])
                            if not put(([start + i for i in idx], encoded)):
                                return
                item = done
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                item = exc
            put(item)

        worker = threading.Thread(target=produce, name="lychee-score-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                positions, batch = item
                yield positions, (batch.result() if pool is not None else batch)
        finally:
            stop.set()
            worker.join(timeout=30)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                for clone in clones:  # the clones' counts belong to this scorer's collator
                    for key, value in clone.stats.as_dict().items():
                        setattr(self.collator.stats, key, getattr(self.collator.stats, key) + value)
                        setattr(clone.stats, key, 0)

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
        on_gpu = device.type == "cuda"
        results: list[tuple[list[int], torch.Tensor]] = []
        # (event, device inputs) of the batches the device may still be working on: the inputs are held until
        # their event, as they were copied on another stream, whose allocations could otherwise be reused early
        # (so up to IN_FLIGHT + 1 batches' inputs are on the device; the pixels travel in the tower's dtype)
        launched: deque = deque()
        copies = torch.cuda.Stream(device) if on_gpu else None
        try:
            with torch.inference_mode():
                for positions, batch in self._prefetched(pairs):
                    if on_gpu:  # copied on their own stream, beside the device's work on the batch before
                        compute = torch.cuda.current_stream(device)
                        with torch.cuda.stream(copies):
                            inputs = to_device(batch, device)
                        compute.wait_stream(copies)
                    else:
                        inputs = to_device(batch, device)
                    probs = self.model.probabilities(self.model(**inputs))
                    if on_gpu:
                        host = torch.empty(probs.shape, dtype=probs.dtype, pin_memory=True)
                        host.copy_(probs, non_blocking=True)  # lands when the device gets there
                        launched.append((torch.cuda.Event(), inputs))
                        launched[-1][0].record(compute)
                        if len(launched) > IN_FLIGHT:
                            launched.popleft()[0].synchronize()  # the device still has the newer batches queued
                        probs = host
                    results.append((positions, probs))
        finally:
            try:
                if on_gpu:  # the one wait for the last scores; on an error, the batch that failed is waited for too
                    torch.cuda.current_stream(device).synchronize()  # before the inputs are let go
            finally:
                launched.clear()
                self.model.train(was_training)
        for positions, probs in results:
            for i, p in zip(positions, probs.float().tolist()):
                scores[i] = float(p)
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
