"""Benchmark of hard-negative mining: the first stage at 10k queries x 100k documents, image hashing, and
rescoring with the built-in tiny reranker on this CPU.

First stage, as ``lychee_pipeline.mining.mine_table`` runs it: tokenize + BM25 index over the documents'
text, BM25 top-``bm25_k`` for every query, pHash top-``image_k`` over every document for the query's two
hashes (its image and its positive's), reciprocal-rank fusion to ``rescore_top``. Texts are synthetic
(Zipf words, ~16 per document, 3-5 per query taken from a target document); hashes are random 64-bit
values (the search cost does not depend on them). Image hashing (pHash + mean colour, once per file, then
cached) is timed on generated JPEGs; rescoring (``Reranker.score_pairs``, the same call mining makes) on
builtin:tiny, CPU. Prints figures; asserts nothing.

    PYTHONPATH=src python benchmarks/mining.py [--queries 10000] [--docs 100000] [--images 300] [--pairs 256]
"""

from __future__ import annotations

import argparse
import platform
import resource
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_texts(n_docs: int, n_queries: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i:05d}" for i in range(30_000)])
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    weights /= weights.sum()
    words = rng.choice(len(vocab), size=(n_docs, 16), p=weights)
    docs = [" ".join(vocab[row]) for row in words]
    targets = rng.integers(0, n_docs, n_queries)
    lengths = rng.integers(3, 6, n_queries)
    queries = [" ".join(vocab[rng.choice(words[t], size=k, replace=False)]) for t, k in zip(targets, lengths)]
    return docs, queries


def first_stage(n_docs: int, n_queries: int, bm25_k: int, image_k: int, rescore_top: int) -> dict[str, float]:
    from lychee_pipeline.mining import ImageIndex, TextIndex, fuse

    docs, queries = synthetic_texts(n_docs, n_queries)
    rng = np.random.default_rng(1)
    doc_hashes = rng.integers(0, 2**63, n_docs, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    query_hashes = [{int(doc_hashes[rng.integers(n_docs)]), int(rng.integers(0, 2**63))} for _ in range(n_queries)]
    out: dict[str, float] = {}
    clock = [time.perf_counter(), time.process_time()]

    def lap(name: str) -> None:
        now = [time.perf_counter(), time.process_time()]
        out[f"{name}_s"], out[f"{name}_cpu_s"] = now[0] - clock[0], now[1] - clock[1]
        clock[:] = now

    text = TextIndex(docs)
    images = ImageIndex(range(n_docs), doc_hashes)
    lap("index")
    bm25 = []
    for start in range(0, n_queries, 512):  # the miner's batch_queries
        bm25 += text.search(queries[start : start + 512], bm25_k)
    lap("bm25")
    near = []
    for start in range(0, n_queries, 512):
        near += images.search(query_hashes[start : start + 512], image_k)
    lap("phash")
    fused = [fuse([[d for d, _ in a], [d for d, _ in b]], rescore_top) for a, b in zip(bm25, near)]
    lap("fuse")
    for suffix in ("_s", "_cpu_s"):
        out[f"total{suffix}"] = sum(out[f"{p}{suffix}"] for p in ("index", "bm25", "phash", "fuse"))
    out["queries_with_bm25_hit"] = sum(1 for b in bm25 if b) / n_queries
    out["mean_candidates"] = float(np.mean([len(f) for f in fused]))
    return out


def image_hashing(n_images: int, folder: Path) -> dict[str, float]:
    from PIL import Image

    from lychee_pipeline.mining import image_signature

    rng = np.random.default_rng(2)
    paths = []
    for i in range(n_images):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(small).resize((800, 800), Image.Resampling.BILINEAR).save(path, quality=90)
        paths.append(str(path))
    t0, c0 = time.perf_counter(), time.process_time()
    for p in paths:
        image_signature(p)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"images": n_images, "seconds": seconds, "images_per_s": n_images / seconds, "cpu_images_per_s": n_images / cpu}


def rescoring(n_pairs: int, folder: Path) -> dict[str, float]:
    import torch
    from PIL import Image

    from lychee_pipeline.reranker.inference import Reranker

    torch.set_num_threads(1)
    rng = np.random.default_rng(3)
    images = []
    for i in range(16):
        path = folder / f"doc{i}.png"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
        images.append(str(path))
    docs, queries = synthetic_texts(n_pairs, n_pairs, seed=4)
    pairs = [({"text": q}, {"text": d, "image": images[i % 16]}) for i, (q, d) in enumerate(zip(queries, docs))]
    reranker = Reranker.from_pretrained("builtin:tiny", device="cpu", batch_size=16, max_pixels=12544,
                                        tiny_cache_dir=str(folder / "tiny"))
    reranker.score_pairs(pairs[:16])  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    reranker.score_pairs(pairs)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"pairs": n_pairs, "seconds": seconds, "pairs_per_s": n_pairs / seconds, "cpu_pairs_per_s": n_pairs / cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--bm25-k", type=int, default=50)
    ap.add_argument("--image-k", type=int, default=20)
    ap.add_argument("--rescore-top", type=int, default=30)
    ap.add_argument("--images", type=int, default=300, help="800x800 JPEGs to hash (0: skip)")
    ap.add_argument("--pairs", type=int, default=256, help="pairs to rescore with builtin:tiny (0: skip)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # one core, as the miner runs beside the rest of the pipeline

    import os

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), "
          f"load average {os.getloadavg()[0]:.1f}; Python {platform.python_version()}")
    print("versions: " + ", ".join(f"{p} {metadata.version(p)}" for p in ("bm25s", "ImageHash", "numpy", "torch")))
    fs = first_stage(args.docs, args.queries, args.bm25_k, args.image_k, args.rescore_top)
    print(f"first stage, {args.queries:,} queries x {args.docs:,} documents "
          f"(bm25_k {args.bm25_k}, image_k {args.image_k}, rescore_top {args.rescore_top}):")
    for name, what in (("index", "index (tokenize + BM25 index + hash array)"), ("bm25", "BM25 search"),
                       ("phash", "pHash search (2 hashes per query)"), ("fuse", "fusion"), ("total", "total")):
        print(f"  {what:<44} wall {fs[name + '_s']:6.1f} s   CPU {fs[name + '_cpu_s']:6.1f} s")
    print(f"  -> {args.queries / fs['total_s']:,.0f} queries/s (wall); "
          f"{fs['mean_candidates']:.1f} candidates/query; queries with a BM25 hit {fs['queries_with_bm25_hit']:.1%}")
    print(f"  peak RSS {_peak_rss_mib():,.0f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        if args.images:
            ih = image_hashing(args.images, Path(tmp))
            print(f"image hashing (pHash + mean colour, 800x800 JPEG q90): {ih['images_per_s']:,.0f} images/s wall, {ih['cpu_images_per_s']:,.0f} per CPU-second "
                  f"-> {args.docs / ih['images_per_s']:,.0f} s for {args.docs:,} images on the first run (cached after)")
        if args.pairs:
            rs = rescoring(args.pairs, Path(tmp))
            print(f"rescoring (Reranker.score_pairs, builtin:tiny, CPU, 1 thread, batch 16, 64x64 images): "
                  f"{rs['pairs_per_s']:,.1f} pairs/s wall ({rs['cpu_pairs_per_s']:,.1f} per CPU-second) -> {args.queries * (args.rescore_top + 1):,} pairs "
                  f"(rescore_top + the positive per query) in {args.queries * (args.rescore_top + 1) / rs['pairs_per_s']:,.0f} s")
    print(f"peak RSS {_peak_rss_mib():,.0f} MiB")


if __name__ == "__main__":
    main()
