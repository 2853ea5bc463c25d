"""Benchmark of the data layer: ingestion + image normalization of 500,000 records over 100,000 images.

Generates its own data in a temporary folder, runs the node functions as the pipeline does, and
prints records/s, images/s and peak RSS (this process and, separately, the image-check workers).

    python benchmarks/data_layer.py [--records 500000] [--images 100000] [--workers 2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import logging
import platform
import resource
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from PIL import Image

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_records
from lychee_pipeline.pipelines.image_normalization.nodes import check_images, normalize_records


def _peak_rss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def _write_images(args: tuple[str, int, int]) -> None:
    folder, start, stop = args
    for i in range(start, stop):
        colour = ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)
        Image.new("RGB", (16, 16), colour).save(f"{folder}/{i // 1000:03d}/{i:06d}.png")


def generate(root: Path, n_records: int, n_images: int, workers: int) -> Path:
    """Write ``n_images`` 16x16 PNGs and a JSONL file of ``n_records`` records (1 positive, 3 negatives)."""
    images = root / "images"
    for d in range(n_images // 1000 + 1):
        (images / f"{d:03d}").mkdir(parents=True, exist_ok=True)
    step = 2000
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write_images, [(str(images), s, min(s + step, n_images)) for s in range(0, n_images, step)]))
    path = root / "records.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for r in range(n_records):
            ids = [(r * 7 + k * 7919) % n_images for k in range(4)]
            docs = [{"text": f"product {i} with a long enough description", "image": f"images/{i // 1000:03d}/{i:06d}.png",
                     "meta": {"popularity": 1.0 / (1 + i)}} for i in ids]
            handle.write(json.dumps({"query": f"query number {r} 第{r}号", "pos_doc": docs[0], "neg_docs": docs[1:]},
                                    ensure_ascii=False) + "\n")
    return path


def main() -> None:
    """Generate, run ingestion + normalization, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the generated folder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(tempfile.mkdtemp(prefix="lychee-bench-"))
    try:
        t0 = time.perf_counter()
        jsonl = generate(root, args.records, args.images, args.workers)
        t_gen = time.perf_counter() - t0
        source = {"files": [str(jsonl)], "image_roots": [str(root)], "demo": False}
        t1 = time.perf_counter()
        records, rejected, counts = ingest_records(source, {"batch_size": 20000, "workers": args.workers, "chunk_mb": 16})
        t_ingest = time.perf_counter() - t1
        t2 = time.perf_counter()
        manifest = check_images(records, None, source, {"workers": args.workers, "max_pixels": 50_000_000})
        t_check = time.perf_counter() - t2
        t3 = time.perf_counter()
        normalized, quarantined, removed, ncounts = normalize_records(records, manifest, source,
                                                                      {"policy": "quarantine", "min_negatives": 1})
        t_norm = time.perf_counter() - t3
        t4 = time.perf_counter()
        manifest2 = check_images(records, manifest, source, {"workers": args.workers, "max_pixels": 50_000_000})
        t_recheck = time.perf_counter() - t4
        total = t_ingest + t_check + t_norm
        figures = {
            "machine": f"{platform.machine()}, {platform.processor() or '?'}, Python {platform.python_version()}",
            "cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "versions": {name: importlib.metadata.version(name) for name in ("pyarrow", "pydantic", "pillow")},
            "records": args.records, "unique_images": manifest.num_rows, "workers": args.workers,
            "generate_s": round(t_gen, 1), "ingest_s": round(t_ingest, 1), "check_images_s": round(t_check, 1),
            "normalize_s": round(t_norm, 1), "ingest_plus_normalize_s": round(total, 1),
            "records_per_s_ingest": round(args.records / t_ingest), "images_per_s": round(manifest.num_rows / t_check),
            "records_per_s_end_to_end": round(args.records / total), "recheck_unchanged_s": round(t_recheck, 1),
            "reused_rows_equal": manifest2.equals(manifest),
            "peak_rss_main_mib": round(_peak_rss_mib(resource.RUSAGE_SELF)),
            "peak_rss_largest_child_mib": round(_peak_rss_mib(resource.RUSAGE_CHILDREN)),
            "counts": {**counts, **ncounts},
        }
        assert counts["clean"] == args.records and not rejected and ncounts["quarantined"] == 0
        print(json.dumps(figures, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
