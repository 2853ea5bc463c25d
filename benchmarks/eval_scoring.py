"""Evaluation scoring rate: the test-set scoring of one model through the launcher on 1 vs N processes.

    PYTHONPATH=src python benchmarks/eval_scoring.py                 # CPU: builtin:tiny, 1 vs 2 processes
    PYTHONPATH=src python benchmarks/eval_scoring.py --processes 1,2,4
    PYTHONPATH=src python benchmarks/eval_scoring.py --cuda          # one GPU: the Qwen2.5-VL-7B architecture
    PYTHONPATH=src python benchmarks/eval_scoring.py --cuda --tiny-arch --queries 2   # that code path, on a CPU

CPU: the pairs (``--queries`` x ``--docs``, text of mixed length, one small PNG per second document, fixed
seed) are written once as Parquet and scored by the same code `kedro run` uses:
``evaluation.scoring.launch_scoring(ScoringJobSpec)`` starts `accelerate launch` with N
gloo processes (1 thread each), every rank scores its shard with ``Reranker.score_pairs`` and rank 0 gathers
the scores. Printed per process count: the scoring rate (pairs / the slowest shard's scoring time), the wall
time of the whole launch (start-up and model load included), and the ratio to 1 process; the scores of every
N are checked against 1 process (max |diff|).

CUDA (``--cuda``): the 7B architecture with random weights in bf16 (``benchmarks/common.py``), pairs of
~600 text tokens and one 448x448 image, scored in this process with ``Reranker.score_pairs`` on one GPU (the
per-GPU rate the sharded scoring multiplies by the run's GPU count). Prints figures, never asserts times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORDS = ("red running shoes for women with a breathable mesh upper stainless steel water bottle that keeps "
         "drinks cold wireless headphones noise cancelling long battery life wooden desk lamp warm light").split()


def make_pairs(folder: Path, n_queries: int, docs: int, seed: int) -> list[tuple[dict, dict]]:
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for i in range(8):
        path = folder / f"img{i}.png"
        side = 56 + 28 * (i % 4)
        Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3))).save(path)
        images.append(str(path))
    pairs = []
    for q in range(n_queries):
        query = {"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 12))), "image": None}
        for d in range(docs):
            doc = {"text": " ".join(rng.choices(WORDS, k=rng.randint(5, 80))),
                   "image": images[rng.randrange(len(images))] if d % 2 else None}
            pairs.append((query, doc))
    return pairs


def versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "machine": platform.machine(), "cpus": str(os.cpu_count()),
            "cpu": _cpu_name()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def cpu_benchmark(args) -> dict:
    from lychee_pipeline.evaluation.score_shards import ScoringJob, ScoringJobSpec, read_scores, write_pairs
    from lychee_pipeline.evaluation.scoring import launch_scoring
    from lychee_pipeline.reranker.tiny import ensure_tiny
    from lychee_pipeline.runtime.settings import LaunchParams

    work = args.work_dir
    os.environ["LYCHEE_TINY_DIR"] = str(ensure_tiny(work / "tiny"))
    pairs = make_pairs(work, args.queries, args.docs, args.seed)
    pairs_path = write_pairs(pairs, work / "pairs.parquet")
    launch = LaunchParams(mixed_precision="no", timeout_s=3600, threads_per_process=args.threads)
    rows, reference = [], None
    for n in [int(p) for p in args.processes.split(",")]:
        for repeat in range(args.repeats):
            out = work / f"p{n}_r{repeat}"
            spec = ScoringJobSpec(stage=f"eval_scoring_{n}", output_dir=str(out.resolve()), launch=launch, jobs=[
                ScoringJob(name="tiny", name_or_path="builtin:tiny", options={"batch_size": args.batch_size},
                           pairs_path=str(pairs_path.resolve()), scores_path=str((out / "scores.parquet").resolve()))])
            started = time.perf_counter()
            result = launch_scoring(spec, n, "cpu")
            wall = time.perf_counter() - started
            job = result["jobs"][0]
            scores = read_scores(job["scores_path"])
            reference = reference or scores
            rows.append({"processes": n, "repeat": repeat, "pairs": len(pairs), "pairs_per_s": job["pairs_per_s"],
                         "scoring_s": job["scoring_seconds"], "load_s": job["load_seconds"], "launch_wall_s": wall,
                         "max_abs_diff_vs_first": max(abs(a - b) for a, b in zip(scores, reference))})
            print(f"processes={n} repeat={repeat}: {job['pairs_per_s']:.1f} pairs/s scoring "
                  f"({job['scoring_seconds']:.2f} s), model load {job['load_seconds']:.1f} s, "
                  f"launch wall {wall:.1f} s, max |diff| vs first {rows[-1]['max_abs_diff_vs_first']:.2e}", flush=True)
    best = {}
    for row in rows:
        best[row["processes"]] = max(best.get(row["processes"], 0.0), row["pairs_per_s"])
    base = best[min(best)]
    summary = {n: {"best_pairs_per_s": r, "ratio_vs_%d" % min(best): r / base} for n, r in best.items()}
    print("\n| processes | best pairs/s | ratio |")
    print("| --- | --- | --- |")
    for n, s in summary.items():
        print(f"| {n} | {s['best_pairs_per_s']:.1f} | {list(s.values())[1]:.2f} |")
    return {"mode": "cpu", "queries": args.queries, "docs": args.docs, "batch_size": args.batch_size,
            "threads_per_process": args.threads, "rows": rows, "summary": summary}


def cuda_benchmark(args) -> dict:
    import torch

    import common
    import inference as inf
    try:
        from lychee_pipeline.evaluation.score_shards import score_pairs_in_slices
    except ImportError:  # a GPU image without the evaluation's metric libraries: the same slicing, inline
        def score_pairs_in_slices(reranker, pairs, progress=None, slice_=1024):
            return [s for i in range(0, len(pairs), slice_) for s in reranker.score_pairs(pairs[i : i + slice_])]
    from lychee_pipeline.reranker.families import qwen2_5_vl
    from lychee_pipeline.reranker.inference import Reranker

    # without CUDA (with --tiny-arch) the same code path runs on the CPU in fp32, to check it, not to time it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = inf.build(tiny=args.tiny_arch, device=device, dtype=dtype, tiny_dir=str(args.work_dir))
    qwen2_5_vl.enable_fast_path(model)  # as load_reranker does with model.fast_path (the default)
    pairs = inf.make_pairs(model.processor, args.queries, args.docs, 600, 0.5, 448, args.seed)
    reranker = Reranker(model, batch_size=args.batch_size)
    score_pairs_in_slices(reranker, pairs[: args.batch_size])  # warm-up
    rows = []
    for repeat in range(args.repeats):
        common.sync(device)
        t0 = time.perf_counter()
        score_pairs_in_slices(reranker, pairs)
        common.sync(device)
        seconds = time.perf_counter() - t0
        rows.append({"repeat": repeat, "pairs": len(pairs), "seconds": seconds, "pairs_per_s": len(pairs) / seconds})
        print(f"repeat={repeat}: {len(pairs)} pairs in {seconds:.1f} s = {len(pairs) / seconds:.2f} pairs/s", flush=True)
    return {"mode": "cuda", "architecture": "tiny" if args.tiny_arch else "qwen2.5-vl-7b (random weights, bf16)",
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "none (CPU)", "batch_size": args.batch_size, "rows": rows,
            "peak_gib": common.peak_gib(device)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="one GPU, the 7B architecture, in this process")
    parser.add_argument("--tiny-arch", action="store_true", help="with --cuda: the miniature architecture")
    parser.add_argument("--processes", default="1,2", help="CPU: process counts to compare, the first is the baseline")
    parser.add_argument("--queries", type=int, default=None, help="default 64 (CPU), 32 (CUDA)")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 (CPU), 32 (CUDA)")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads per process")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="data, model folders and shards (kept; default: a temporary folder, removed at the end)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    args.queries = args.queries or (32 if args.cuda else 64)
    args.batch_size = args.batch_size or (32 if args.cuda else 16)
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "versions": versions()}
    print(json.dumps(info))
    import common

    with common.scratch_folder("eval_scoring_", args.work_dir) as work:
        args.work_dir = work  # both benchmarks read their folder from args
        figures = {**info, **(cuda_benchmark(args) if args.cuda else cpu_benchmark(args))}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
