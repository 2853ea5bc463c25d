"""Scoring API: ``Reranker.score(query, docs)`` -> p(yes) per document, ``rerank`` -> best first.

Pairs are prepared in chunks, sorted by token length inside each chunk and batched, so batches carry
little padding; results come back in input order. Runs under ``torch.inference_mode``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PairCollator
from .model import LycheeReranker, ModelConfig, load_reranker, read_metadata

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
    ):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model = model
        self.batch_size = int(batch_size)
        self.chunk_size = int(batch_size) * max(int(chunk_batches), 1)
        self.collator = PairCollator(model.processor, max_length, min_pixels, max_pixels, instructions)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        adapter: str | None = None,
        device: str | torch.device | None = "auto",
        batch_size: int = 32,
        max_length: int = DEFAULT_MAX_LENGTH,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        instructions: Mapping[str, str] | None = None,
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        local_files_only: bool = False,
        tiny_cache_dir: str | None = None,
    ) -> Reranker:
        """Load a hub id, a local folder or ``builtin:tiny`` (+ an optional LoRA adapter folder).

        A folder saved by ``LycheeReranker.save_pretrained`` that holds only an adapter may be passed
        as ``name_or_path``: its base model is read from its metadata.
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
        return cls(model, batch_size, max_length, min_pixels, max_pixels, instructions)

    # -- scoring ----------------------------------------------------------------------------------
    def score_pairs(self, pairs: Sequence[Sequence[Any]]) -> list[float]:
        """p(yes) for each ``(query, doc)`` or ``(query, doc, instruction)`` pair, in input order.

        Pairs are sorted by length within chunks (little padding). Each batch's scores stay on the device
        until the next batch is encoded on the host, so image decoding and tokenization overlap the GPU.
        """
        scores: list[float] = [0.0] * len(pairs)
        was_training = self.model.training
        self.model.eval()
        device = self.model.device
        pending: tuple[list[int], int, torch.Tensor] | None = None

        def read_back() -> None:
            idx, start, probs = pending
            for i, p in zip(idx, probs.float().cpu().tolist()):
                scores[start + i] = float(p)

        try:
            with torch.inference_mode():
                for start in range(0, len(pairs), self.chunk_size):
                    chunk = [self.collator.prepare(p) for p in pairs[start : start + self.chunk_size]]
                    order = sorted(range(len(chunk)), key=lambda i: chunk[i][2])
                    for b in range(0, len(order), self.batch_size):
                        idx = order[b : b + self.batch_size]
                        batch = self.collator.encode([chunk[i] for i in idx])
                        batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                                 for k, v in batch.items()}
                        if pending is not None:
                            read_back()
                        pending = (idx, start, self.model.probabilities(self.model(**batch)))
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
