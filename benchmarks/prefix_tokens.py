"""Tokens the language model runs with and without prefix reuse, on ``benchmarks/inference.py``'s pairs (host only).

    PYTHONPATH=src python benchmarks/prefix_tokens.py --images jpeg800                  # the 7B benchmark's pairs
    PYTHONPATH=src python benchmarks/prefix_tokens.py --images jpeg800 --query-images   # queries with an image

The pairs are made as ``inference.py`` makes them for the 7B run (same processor, text lengths, images, seed;
the 7B benchmark tokenizes with the built-in tiny processor), and the scorer's own host preparation packs them
(``Reranker.batches``: chunks, sorted batches, ``host_inputs``) with the built-in tiny model's config for the
positions; no forward runs, so this counts on a CPU what the GPU run will do. Prints the tokens and images the
language model and vision tower get per call, plain and with ``prefix_reuse``, and the share saved.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from inference import jpeg_files, make_pairs  # noqa: E402

from lychee_pipeline.reranker.inference import Reranker  # noqa: E402
from lychee_pipeline.reranker.model import ModelConfig, load_reranker  # noqa: E402


def count(scorer: Reranker, pairs) -> dict:
    """Tokens, image tokens' images and batches of the scorer's host batches for ``pairs``."""
    tokens = images = batches = 0
    for _, batch in scorer.batches(pairs):
        packed = batch["packed"]
        tokens += packed.tokens
        images += 0 if packed.image_grid_thw is None else int(packed.image_grid_thw.shape[0])
        batches += 1
    return {"tokens": tokens, "images": images, "batches": batches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", choices=("memory", "jpeg800", "mixed"), default="jpeg800")
    parser.add_argument("--queries", type=int, default=48)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--text-tokens", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--query-images", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    with common.scratch_folder("lychee_prefix_tokens_") as work:
        model = load_reranker(ModelConfig(name_or_path="builtin:tiny", tiny_cache_dir=str(work / "tiny"),
                                          finetune="frozen"), device="cpu")
        paths = None if args.images == "memory" else jpeg_files(work / "jpegs", args.images, 48, args.seed)
        pairs = make_pairs(model.processor, args.queries, args.docs, args.text_tokens, 0.5, 448, args.seed, paths,
                           args.query_images)
        figures = {}
        for reuse in (False, True):
            scorer = Reranker(model, batch_size=args.batch_size, first_batch=8, prefix_reuse=reuse)
            figures[reuse] = count(scorer, pairs)
        plain, shared = figures[False], figures[True]
        common.log(f"{len(pairs)} pairs ({args.queries} queries x {args.docs} documents, {args.images} images"
                   f"{', queries with an image' if args.query_images else ''}), batches of {args.batch_size} "
                   f"(first batch 8, as on a GPU): {plain['batches']} batches")
        common.log(f"plain:        {plain['tokens']} tokens ({plain['tokens'] / len(pairs):.0f} a pair), "
                   f"{plain['images']} images through the vision tower")
        common.log(f"prefix reuse: {shared['tokens']} tokens ({shared['tokens'] / len(pairs):.0f} a pair), "
                   f"{shared['images']} images through the vision tower")
        common.log(f"saved: {100 * (1 - shared['tokens'] / plain['tokens']):.1f}% of the language model's tokens, "
                   f"{100 * (1 - shared['images'] / max(plain['images'], 1)):.1f}% of the images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
