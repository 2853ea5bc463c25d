"""First stage of hard-negative mining: BM25 over document text and image neighbours by perceptual hash.

Both are cheap enough for 10k queries x 100k documents on two CPU cores; the reranker then rescores only
the few best candidates of each query (see :mod:`lychee_pipeline.mining.mine`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

# Scripts written without spaces between words: indexed as characters and character bigrams.
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_WORD = re.compile(r"\w+")
_SEGMENT = re.compile(_CJK.pattern + "+|" + _CJK.pattern.replace("[", "[^", 1) + "+")
_STOP = frozenset(
    "a an and are as at be by for from has have in is it its of on or that the this to was were with".split()
)


def normalize_text(text: str | None) -> str:
    """Text as compared by the same-text filter: NFKC, case-folded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text or "").casefold().split())


def tokenize(text: str | None) -> list[str]:
    """BM25 tokens: case-folded words of two or more characters (English stop words dropped); runs of
    Chinese, Japanese or Korean characters as single characters and character bigrams."""
    tokens: list[str] = []
    for word in _WORD.findall(normalize_text(text)):
        for part in _SEGMENT.findall(word):
            if _CJK.match(part):
                tokens.extend(part)
                tokens.extend(part[i : i + 2] for i in range(len(part) - 1))
            elif len(part) > 1 and part not in _STOP:
                tokens.append(part)
    return tokens


class TextIndex:
    """BM25 (``bm25s``, Lucene variant) over the documents' text; documents without text are never returned."""

    def __init__(self, texts: Sequence[str | None]):
        import bm25s

        self.n_docs = len(texts)
        corpus = [tokenize(t) for t in texts]
        self._retriever = bm25s.BM25()
        self._retriever.index(corpus, show_progress=False)

    def search(self, queries: Sequence[str | None], k: int, n_threads: int = 1) -> list[list[tuple[int, float]]]:
        """The top ``k`` documents ``(index, score)`` of each query, best first (score > 0 only)."""
        k = min(int(k), self.n_docs)
        out: list[list[tuple[int, float]]] = [[] for _ in queries]
        tokens = [tokenize(q) for q in queries]
        todo = [i for i, t in enumerate(tokens) if t]
        if not todo or k < 1:
            return out
        docs, scores = self._retriever.retrieve(
            [tokens[i] for i in todo], k=k, show_progress=False, n_threads=n_threads
        )
        for row, i in enumerate(todo):
            out[i] = [(int(d), float(s)) for d, s in zip(docs[row], scores[row]) if s > 0]
        return out


# -- images ----------------------------------------------------------------------------------------------

def image_signature(path: str, hash_size: int = 8) -> tuple[int, tuple[int, int, int]]:
    """Perceptual hash (DCT pHash, ``hash_size``² bits) of the upright image, and its mean RGB colour.

    pHash works on grey levels, so two products that differ only in colour hash alike; the mean colour
    tells them apart in the near-duplicate test.
    """
    import imagehash
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        im.draft("RGB", (256, 256))  # JPEG: decode at reduced size, plenty for a 32x32 DCT
        rgb = im.convert("RGB")
    bits = imagehash.phash(rgb, hash_size=hash_size).hash.flatten()
    value = 0
    for b in bits:
        value = (value << 1) | int(b)
    small = np.asarray(rgb.resize((16, 16)), dtype=np.float32)
    colour = tuple(int(round(c)) for c in small.reshape(-1, 3).mean(axis=0))
    return value, colour  # type: ignore[return-value]


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bit distance between uint64 hashes (broadcasting)."""
    return np.bitwise_count(np.bitwise_xor(a, b)).astype(np.int16)


class ImageIndex:
    """Nearest documents by pHash distance (exact, vectorised over the whole catalogue in chunks)."""

    def __init__(self, doc_index: Sequence[int], hashes: Sequence[int]):
        self.doc_index = np.asarray(doc_index, dtype=np.int64)
        self.hashes = np.asarray([int(h) for h in hashes], dtype=np.uint64)

    def search(self, query_hashes: Sequence[Iterable[int]], k: int, chunk: int = 64) -> list[list[tuple[int, int]]]:
        """For each query (a set of hashes: its image, its positives' images), the ``k`` documents nearest to
        any of them ``(document index, distance)``, nearest first."""
        out: list[list[tuple[int, int]]] = [[] for _ in query_hashes]
        n = len(self.hashes)
        if n == 0 or k < 1:
            return out
        k = min(int(k), n)
        rows = [(qi, int(h)) for qi, hs in enumerate(query_hashes) for h in hs]
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            qh = np.asarray([h for _, h in part], dtype=np.uint64)
            dist = hamming(qh[:, None], self.hashes[None, :])
            top = np.argpartition(dist, k - 1, axis=1)[:, :k] if k < n else np.tile(np.arange(n), (len(part), 1))
            for r, (qi, _) in enumerate(part):
                out[qi].extend((int(self.doc_index[j]), int(dist[r, j])) for j in top[r])
        for qi, found in enumerate(out):
            best: dict[int, int] = {}
            for d, dd in found:
                if d not in best or dd < best[d]:
                    best[d] = dd
            out[qi] = sorted(best.items(), key=lambda t: (t[1], t[0]))[:k]
        return out


def fuse(rankings: Sequence[Sequence[int]], k: int, rrf_k: int = 60) -> list[int]:
    """Reciprocal-rank fusion of several rankings of document indices: the first ``k``."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, d in enumerate(ranking):
            score[d] = score.get(d, 0.0) + 1.0 / (rrf_k + rank + 1)
    return sorted(score, key=lambda d: (-score[d], d))[:k]
