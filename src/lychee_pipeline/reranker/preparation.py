"""Host preparation of scoring batches: what the host does so the device only runs the model.

Pairs are measured in chunks (token counts from the text and the image headers, no decoding), sorted by token
length inside each chunk and cut into batches, so batches carry little padding; every batch keeps the positions
of its pairs in the input, so the scores go back in input order. Each batch is then decoded, tokenized and
encoded by the processor, and made into what the model's forward takes (``LycheeReranker.host_inputs``: for a
model that packs pairs, the packed sequence, its positions and the vision tower's grid-derived inputs, the pixels
cast to the tower's dtype), page-locked on a GPU.

:class:`HostPreparation` does that in the calling thread (:meth:`~HostPreparation.batches`) or ahead of the
device (:meth:`~HostPreparation.prefetched`): a producer thread fills a bounded queue (:class:`Handoff`),
alone or handing the measuring and encoding to a pool of threads that each own a collator
(:class:`PreparingPool`). The device loop that consumes the batches is ``Reranker.score_pairs``
(``reranker/inference.py``).
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..host import cpus_available
from .collate import PairCollator
from .model import LycheeReranker
from .packing import PackedBatch, varlen_attention_ready

Prepared = tuple[str, list[Any], int]  # a pair's prompt, its images (sized or decoded), its token count
HostBatch = tuple[list[int], Any]  # (positions in the input, the host batch or a Future of it)


def auto_preparing_threads(device_type: str, varlen_attention: bool, cpus: int) -> int:
    """``prepare_workers: auto``: two host threads where the launching thread is light (CUDA, the packed pairs'
    attention one variable-length call per layer) and the CPUs are there, else one (see ``Reranker.__init__``)."""
    return 2 if device_type == "cuda" and varlen_attention and cpus >= 4 else 1


def measure_pairs(collator: PairCollator, pairs: Sequence[Sequence[Any]]) -> list[Prepared]:
    """Prompts rendered, tokens counted and truncation applied, images only sized from their headers."""
    return [collator.prepare(p, decode=False, count=True) for p in pairs]


class Handoff:
    """The bounded queue between the producing thread and the device loop, with a stop signal: a producer
    blocked on a full queue gives up once the consumer has stopped (an error, or a consumer that left early)."""

    _DONE = object()

    def __init__(self, size: int):
        self.ready: queue.Queue = queue.Queue(maxsize=size)
        self.stopped = threading.Event()

    def put(self, item: Any) -> bool:
        """Queue ``item``, waiting for room; False once the consumer has stopped."""
        while not self.stopped.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce(self, fill: Callable[[Handoff], None]) -> None:
        """Run ``fill(self)`` (the producer's body), then queue the end mark, or the error it raised."""
        try:
            fill(self)
            item = self._DONE
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            item = exc
        self.put(item)

    def items(self) -> Iterator[Any]:
        """The queued items in order, until the end mark; an error from the producer is raised here."""
        while True:
            item = self.ready.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self.stopped.set()


class PreparingPool:
    """Host threads that each prepare with a collator of their own (its own copy of the processor), lent out
    one job at a time."""

    def __init__(self, collators: list[PairCollator]):
        self.collators = collators
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for collator in collators:
            self._free.put(collator)
        self._executor = ThreadPoolExecutor(len(collators), thread_name_prefix="lychee-score-prepare")

    def _with_collator(self, fn: Callable[..., Any], *args: Any) -> Any:
        collator = self._free.get()
        try:
            return fn(collator, *args)
        finally:
            self._free.put(collator)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(collator, *args)`` on a pool thread, with a free collator."""
        return self._executor.submit(self._with_collator, fn, *args)

    def measure(self, pairs: Sequence[Sequence[Any]], start: int, end: int) -> list[Future]:
        """``pairs[start:end]`` measured in slices, two per thread so that the threads finish together."""
        step = max(1, -(-(end - start) // (2 * len(self.collators))))
        return [self.submit(measure_pairs, pairs[s : min(end, s + step)]) for s in range(start, end, step)]

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class HostPreparation:
    """The host side of a scorer: chunks, sorting, batches, the preparing threads and their bounded queue.

    ``collator`` holds the processing settings (a caller may change them between calls, e.g. ``set_max_pixels``:
    the threads' own collators follow). See ``Reranker.__init__`` for ``prefetch_batches``, ``prepare_workers``
    and ``first_batch``.
    """

    def __init__(self, model: LycheeReranker, collator: PairCollator, batch_size: int, chunk_batches: int,
                 prefetch_batches: int, prepare_workers: int | str, first_batch: int | str):
        self.model = model
        self.collator = collator
        self.batch_size = int(batch_size)
        self.chunk_size = int(batch_size) * max(int(chunk_batches), 1)
        self.prefetch_batches = max(int(prefetch_batches), 0)
        self.prepare_workers = prepare_workers
        self.first_batch = first_batch
        self.prefix_reuse = False  # pairs that begin alike share one prefix segment (Reranker's prefix_reuse)
        self.keyed_images = False  # each image hashed for the scorer's vision feature cache (Reranker's vision_cache)
        self.clones: list[PairCollator] = []  # the extra threads' collators, made once and reused

    # -- sizes ----------------------------------------------------------------------------------
    def threads(self) -> int:
        """Host threads preparing batches (``prepare_workers``; auto: :func:`auto_preparing_threads`)."""
        if self.prepare_workers != "auto":
            return max(int(self.prepare_workers), 1)
        device = self.model.device
        return auto_preparing_threads(device.type, self.model.config.pack_pairs and varlen_attention_ready(device),
                                      cpus_available())

    def first_batch_size(self) -> int:
        """Pairs of the first, smaller batch (0: none; auto: a quarter batch on a GPU)."""
        if self.first_batch == "auto":
            return max(1, self.batch_size // 4) if self.model.device.type == "cuda" and self.batch_size > 1 else 0
        return min(max(int(self.first_batch), 0), self.batch_size)

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """``(start, end)`` of the chunks sorted and batched together. With a first batch of F pairs (more
        than one batch of input only): F, 2F, 4F ... pairs while less than a batch, then chunks of 1, 2, 4 ...
        batches up to ``chunk_size``, so each chunk's device time covers the host's preparing of the next (the
        host prepares a pair in less time than the device scores it); else chunks of ``chunk_size``."""
        first = self.first_batch_size()
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

    def batch_order(self, chunk: list[Prepared]) -> list[list[int]]:
        """The chunk's indices sorted by token count, cut into batches; with prefix reuse sorted by prompt first,
        so that a query's candidates (the same prompt up to the document) are neighbours in a batch."""
        if self.prefix_reuse:
            order = sorted(range(len(chunk)), key=lambda i: (chunk[i][0], chunk[i][2]))
        else:
            order = sorted(range(len(chunk)), key=lambda i: chunk[i][2])
        return [order[b : b + self.batch_size] for b in range(0, len(order), self.batch_size)]

    # -- one batch --------------------------------------------------------------------------------
    def encode(self, collator: PairCollator, prepared: list[Prepared]) -> dict[str, Any]:
        """The host batch of measured pairs: images decoded, the processor run, the model's host inputs made."""
        # the packed sequence and the grid-derived inputs are worked out here too, off the launching thread
        batch = self.model.host_inputs(collator.encode(collator.decode_batch(prepared)), self.prefix_reuse,
                                         self.keyed_images)
        if self.model.device.type == "cuda":  # page-locked, so the copy to the GPU is asynchronous
            batch = {k: v.pin_memory() if isinstance(v, (torch.Tensor, PackedBatch)) else v for k, v in batch.items()}
        return batch

    # -- in the calling thread --------------------------------------------------------------------
    def batches(self, pairs: Sequence[Sequence[Any]]) -> Iterator[HostBatch]:
        """``(positions in pairs, host batch)`` in scoring order: chunks (:meth:`chunk_bounds`) sorted by token
        count (measured without decoding images), then cut into batches of ``batch_size``; in this thread. A host
        batch is what the model's forward takes (``LycheeReranker.host_inputs``: a packed model's
        ``{"packed": PackedBatch}``), page-locked on a GPU."""
        for start, end in self.chunk_bounds(len(pairs)):
            # prompts rendered, tokens counted and truncation applied once; images decoded only per batch
            chunk = measure_pairs(self.collator, pairs[start:end])
            for idx in self.batch_order(chunk):
                yield [start + i for i in idx], self.encode(self.collator, [chunk[i] for i in idx])

    # -- ahead of the device ----------------------------------------------------------------------
    def worker_collators(self, count: int) -> list[PairCollator]:
        """``count`` collators with this scorer's settings, each with its own copy of the processor."""
        while len(self.clones) < count:
            self.clones.append(PairCollator(copy.deepcopy(self.model.processor), self.collator.max_length,
                                            self.collator.min_pixels, self.collator.max_pixels,
                                            family=self.collator.family))
        for clone in self.clones[:count]:  # follow changes made to the main collator (set_max_pixels ...)
            clone.max_length, clone.min_pixels = self.collator.max_length, self.collator.min_pixels
            clone.max_pixels, clone.instructions = self.collator.max_pixels, self.collator.instructions
        return self.clones[:count]

    def prefetched(self, pairs: Sequence[Sequence[Any]]) -> Iterator[HostBatch]:
        """The batches of :meth:`batches`, in the same order and composition, prepared ahead by host threads:
        at most ``prefetch_batches`` ready and waiting. One thread: :meth:`batches` in a producer thread.
        Several: the producer hands the measuring of each chunk (in slices) and the encoding of each batch to a
        pool whose threads each use their own collator; the next chunk is measured while this one is scored."""
        if self.prefetch_batches == 0:
            yield from self.batches(pairs)
            return
        workers = self.threads()
        handoff = Handoff(self.prefetch_batches)
        pool = PreparingPool(self.worker_collators(workers)) if workers > 1 else None
        if pool is None:
            fill = functools.partial(self._fill_from_this_thread, pairs)
        else:
            fill = functools.partial(self._fill_from_pool, pairs, pool)
        producer = threading.Thread(target=handoff.produce, args=(fill,), name="lychee-score-prefetch", daemon=True)
        producer.start()
        try:
            for positions, batch in handoff.items():
                yield positions, (batch.result() if pool is not None else batch)
        finally:
            handoff.stop()
            producer.join(timeout=30)
            if pool is not None:
                pool.close()
                self._take_counts(pool.collators)

    def _fill_from_this_thread(self, pairs: Sequence[Sequence[Any]], out: Handoff) -> None:
        for item in self.batches(pairs):
            if not out.put(item):
                return

    def _fill_from_pool(self, pairs: Sequence[Sequence[Any]], pool: PreparingPool, out: Handoff) -> None:
        """Queue each batch's encoding (a Future, in scoring order); the next chunk is measured behind this chunk's
        first batch, not before it."""
        bounds = self.chunk_bounds(len(pairs))
        measured = pool.measure(pairs, *bounds[0]) if bounds else []
        for k, (start, _) in enumerate(bounds):
            chunk = [prepared for part in measured for prepared in part.result()]
            for j, idx in enumerate(self.batch_order(chunk)):
                encoded = pool.submit(self.encode, [chunk[i] for i in idx])
                if j == 0 and k + 1 < len(bounds):
                    measured = pool.measure(pairs, *bounds[k + 1])
                if not out.put(([start + i for i in idx], encoded)):
                    return

    def _take_counts(self, collators: list[PairCollator]) -> None:
        """Move the threads' truncation counts into this scorer's collator (they belong to it)."""
        for clone in collators:
            for key, value in clone.stats.as_dict().items():
                setattr(self.collator.stats, key, getattr(self.collator.stats, key) + value)
                setattr(clone.stats, key, 0)

