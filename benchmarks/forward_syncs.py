"""Where the scoring forward waits for the device (CUDA GPU only; an attribution tool, not a figure of merit).

    PYTHONPATH=src python benchmarks/forward_syncs.py
    PYTHONPATH=src python benchmarks/forward_syncs.py --family qwen3_vl --size 2b

The 7B architecture (or ``--family`` / ``--size``) with random weights, set up as ``Reranker.from_pretrained`` does (fused kernels, packed
pairs, fast vision path), 64 pairs with mixed-size JPEG documents prepared by ``Reranker.batches`` (on the host,
as the scorer's preparing thread does). Prints, per batch, the host time spent inside the forward against the
device time of the forward (a forward that waits for the device returns only when the device is done: the two
are then equal), then every call of one forward that ``torch.cuda.set_sync_debug_mode`` reports as
synchronising, grouped by where it was made, and checks PyTorch's variable-length attention against per-pair
SDPA on grouped-query heads.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import inference  # noqa: E402

from lychee_pipeline.reranker.inference import Reranker, to_device  # noqa: E402
from lychee_pipeline.reranker.kernels import apply_kernels  # noqa: E402
from lychee_pipeline.reranker.packing import _varlen_attention, enable_packed_attention  # noqa: E402
from lychee_pipeline.reranker.vision_cache import VisionFeatureCache  # noqa: E402


def count_syncs(model, batch: dict, **kwargs) -> collections.Counter:
    """The synchronising calls of one forward (``torch.cuda.set_sync_debug_mode``), by call site."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                  if "site-packages/torch" not in f.filename and "warnings" not in f.filename]
        sites[" <- ".join(reversed(frames[-4:]))] += 1

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            model(**batch, **kwargs)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    return sites


def report(context: str, sites: collections.Counter) -> None:
    print(f"synchronising calls in one forward{context}: {sum(sites.values())}")
    for site, count in sites.most_common(25):
        print(f"{count:5d}  {site}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=tuple(common.SIZES), default="qwen2_5_vl")
    parser.add_argument("--size", default=None, help="published size: 7b (qwen2_5_vl); 2b or 8b (qwen3_vl)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("forward_syncs.py needs a CUDA GPU")
        return 2
    common.select_architecture(args.family, args.size)
    device = torch.device("cuda")
    with common.scratch_folder("lychee_syncs_") as folder:
        model = inference.build(False, device, torch.bfloat16, folder)
        apply_kernels(model.base_model, "auto", device)
        enable_packed_attention(model.base_model)
        common.family().enable_fast_path(model)
        paths = inference.jpeg_files(Path(folder) / "jpegs", "mixed", 16, 7)
        pairs = inference.make_pairs(model.processor, 8, 8, 600, 0.5, 448, 7, paths)
        batches = [to_device(batch, device) for _, batch in Reranker(model, batch_size=32).batches(pairs)]
        with torch.inference_mode():
            for batch in batches:  # warm-up
                model(**batch)
            torch.cuda.synchronize()
            for batch in batches:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                start.record()
                model(**batch)
                t1 = time.perf_counter()
                end.record()
                torch.cuda.synchronize()
                print(f"batch of {batch['packed'].pairs} pairs: host in the forward {1000 * (t1 - t0):.0f} ms, "
                      f"device {start.elapsed_time(end):.0f} ms", flush=True)

            last = batches[-1]
            report("", count_syncs(model, last))
            # the vision cache's partial path: half of the batch's distinct images known, the rest run through the tower
            cache = VisionFeatureCache(16 * 2**30)
            model(**last, vision_cache=cache)
            keys = list(dict.fromkeys(last["packed"].image_keys))
            for key in keys[::2]:
                cache.discard(key)
            report(f", vision cache holding {len(cache)} of its {len(keys)} distinct images",
                   count_syncs(model, last, vision_cache=cache))

    varlen = _varlen_attention()
    if varlen is None:
        print("torch.nn.attention.varlen: not in this torch")
        return 0
    attend, gqa_keyword = varlen
    q = torch.randn(300, 28, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(300, 4, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    bounds = [(0, 100), (100, 300)]
    cu = torch.tensor([0, 100, 300], device=device, dtype=torch.int32)
    out = attend(q, k, v, cu, cu, 200, 200, **({"enable_gqa": True} if gqa_keyword else {}))
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        for a, b in bounds])
    print(f"variable-length attention (28 query / 4 key heads) against per-pair SDPA: max |diff| "
          f"{(out.float() - ref.float()).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
