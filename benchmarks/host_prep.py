"""Host-side cost of preparing inputs: JPEG decoding with and without reduced-scale decoding (``Image.draft``),
and the collator per group of 8 pairs, at two pixel budgets. CPU only; no model.

    PYTHONPATH=src python benchmarks/host_prep.py [--repeats 5]

Images: generated photo-like JPEGs (quality 90) of 800x800, 1600x1200 and 3000x2000 on disk. The collator is
the project's ``PairCollator`` with the built-in tiny processor (same image processing as Qwen2.5-VL; the
fast torchvision image processor when torchvision is installed, else the PIL one: printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from lychee_pipeline.reranker import collate  # noqa: E402
from lychee_pipeline.reranker.collate import PairCollator, load_image  # noqa: E402
from lychee_pipeline.reranker.families.qwen2_5_vl.processor import image_processor_kind, load_processor  # noqa: E402
from lychee_pipeline.reranker.prompt import instruction_for  # noqa: E402
from lychee_pipeline.reranker.tiny import ensure_tiny  # noqa: E402
from train_stage import make_jpegs  # noqa: E402

BUDGETS = {"448²": 448 * 448, "default 1280·28²": 1280 * 28 * 28}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with common.scratch_folder("lychee_host_prep_") as work:
        processor = load_processor(str(ensure_tiny(str(work / "tiny"))))
        sizes = [(800, 800), (1600, 1200), (3000, 2000)]
        files = {f"{w}x{h}": make_jpegs(work / f"img_{w}x{h}", 8, 800, 3, sizes=[(w, h)]) for w, h in sizes}
        kind = image_processor_kind(processor)
        print(f"image processor: {type(processor.image_processor).__name__} ({kind})", flush=True)
        results: dict = {"image_processor": kind, "decode_ms": {}, "collate_ms_per_group": {}}

        factor = collate.DRAFT_FACTOR
        print(f"\n{'image':>10} {'budget':>18} {'full decode ms':>15} {'drafted ms':>11} {'drafted size':>13}")
        for name, paths in files.items():
            for label, budget in BUDGETS.items():
                full = median_ms(lambda: [load_image(p) for p in paths], args.repeats) / len(paths)
                drafted = median_ms(lambda: [load_image(p, budget) for p in paths], args.repeats) / len(paths)
                size = load_image(paths[0], budget).size
                results["decode_ms"][f"{name} @ {label}"] = {"full": full, "drafted": drafted, "drafted_size": size}
                print(f"{name:>10} {label:>18} {full:15.1f} {drafted:11.1f} {str(size):>13}", flush=True)

        print(f"\ncollator, one group of 8 pairs (~600 text tokens, one JPEG each): prepare + processor")
        print(f"{'image':>10} {'budget':>18} {'no draft ms':>12} {'draft ms':>9} {'tokens/pair':>12}")
        query = {"text": "red running shoes", "image": None}
        text = " ".join(["a comfortable red running shoe with a breathable mesh upper and a light sole"] * 24)
        instruction = instruction_for("t2it")
        for name, paths in files.items():
            pairs = [(query, {"text": text, "image": p}, instruction) for p in paths]
            for label, budget in BUDGETS.items():
                collator = PairCollator(processor, max_length=3200, max_pixels=budget)
                row = {}
                for mode, draft_factor in (("no_draft", float("inf")), ("draft", factor)):
                    collate.DRAFT_FACTOR = draft_factor
                    row[mode] = median_ms(lambda: collator(pairs), max(2, args.repeats // 2))
                collate.DRAFT_FACTOR = factor
                tokens = collator(pairs)["attention_mask"].sum(dim=1).float().mean().item()
                row["tokens_per_pair"] = tokens
                results["collate_ms_per_group"][f"{name} @ {label}"] = row
                print(f"{name:>10} {label:>18} {row['no_draft']:12.0f} {row['draft']:9.0f} {tokens:12.0f}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "host_prep.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
