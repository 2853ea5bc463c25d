"""Where the vision tower's time goes when scoring (CUDA GPU; an attribution tool, not a figure of merit).

    PYTHONPATH=src python benchmarks/vision_tower.py                    # Lychee 7B's tower, 800x800 JPEGs
    PYTHONPATH=src python benchmarks/vision_tower.py --family qwen3_vl --size 2b
    PYTHONPATH=src python benchmarks/vision_tower.py --tiny     # the same code paths on a CPU (host times)

The tower of the 7B architecture (or ``--family`` / ``--size``) with random weights, set up as
``Reranker.from_pretrained`` sets it up (fast vision path), on the packed batches ``Reranker.batches`` prepares
from 800x800 JPEG documents (one distinct image per pair, 32 pairs a batch). Prints, step by step from the stock
transformers forward to the library's default (batched attention, the patch embedding as a matmul, liger's vision
kernels and the vision MLP padded to a multiple of 64 where the family has them; then the rotary's and the
padding's shares), the tower's time over the batches, its rate against its matmul FLOPs (2 x tower params x patches) and the
measured bf16 matmul rate, and the largest difference of its features from the stock forward's; then the
``torch.profiler`` table of its CUDA kernels for one batch (the largest first), grouped by kind: matmuls,
attention, and everything else (elementwise, norms, copies).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import inference  # noqa: E402

from lychee_pipeline.reranker.inference import Reranker, to_device  # noqa: E402
from lychee_pipeline.reranker.packing import enable_packed_attention  # noqa: E402

KINDS = (("matmul", ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas", "aten::mm", "aten::addmm",
                     "aten::linear", "aten::bmm")),
         ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


@dataclass
class Tower:
    """The tower under test and the batches it runs on."""

    model: Any  # the LycheeReranker holding it
    batches: list
    device: torch.device
    matmul_tflops: float

    @property
    def vl_model(self) -> Any:
        return self.model.base_model.model

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.vl_model.visual.parameters())

    @property
    def patches(self) -> int:
        return sum(int(p.pixel_values.shape[0]) for p in self.batches)

    @property
    def largest(self) -> Any:
        return max(self.batches, key=lambda p: p.pixel_values.shape[0])

    def run(self, packed) -> Any:
        return self.vl_model.get_image_features(packed.pixel_values, packed.image_grid_thw, return_dict=True,
                                                **packed.vision_to_device, **packed.vision_on_host)

    @torch.inference_mode()
    def measure(self, label: str, reference: torch.Tensor | None = None) -> torch.Tensor:
        """Time the tower over the batches after a warm-up (kernels chosen, Triton compiled); print the line and
        return the largest batch's features (compared with ``reference``)."""
        for packed in self.batches:
            self.run(packed)
        common.sync(self.device)
        t0 = time.perf_counter()
        for packed in self.batches:
            self.run(packed)
        common.sync(self.device)
        secs = time.perf_counter() - t0
        rate = 2 * self.params * self.patches / secs / 1e12
        features = torch.cat(self.run(self.largest).pooler_output).float()
        parity = ("" if reference is None else
                  f"; features against the first line's: max |d| {(features - reference).abs().max().item():.3g} "
                  f"(their max |x| {reference.abs().max().item():.3g})")
        print(f"{label:<60} {secs:6.2f} s  {rate:6.3g} TFLOP/s = {100 * rate / self.matmul_tflops:5.1f}% of "
              f"measured{parity}")
        return features


def time_steps(tower: Tower) -> None:
    """The steps of the tower's fast path, one at a time on the same batches: each line adds one."""
    from lychee_pipeline.reranker import kernels
    from lychee_pipeline.reranker.families.patch_embed import disable_matmul_patch_embed

    family = common.family()
    family.disable_fast_path(tower.model)
    reference = tower.measure("stock transformers forward (SDPA per window / image)")
    family.enable_fast_path(tower.model)
    if disable_matmul_patch_embed(tower.model):  # the family's fast path runs its patch embedding as a matmul
        tower.measure("+ one attention call per window or image size", reference)
        family.enable_fast_path(tower.model)
        tower.measure("+ patch embedding as a matmul", reference)
    else:
        tower.measure("+ one attention call per window or image size (the fast path)", reference)
    applied = kernels.apply_kernels(tower.model.base_model, "auto", tower.device)
    if applied != "liger":
        print(f"fused kernels: {applied} (the family or the machine does not take liger)")
        return
    targets = family.fused_kernel_targets()
    plan = kernels.liger_plan(tower.vl_model.visual, targets)  # what liger switched inside the tower
    widths = sum(kernels.UNPADDED_FORWARD in mlp.__dict__ for mlp in plan.swiglu_mlps)
    tower.measure(f"+ liger in the tower: {len(plan.rms_norms)} RMSNorm, {len(plan.swiglu_mlps)} SwiGLU ({widths} "
                  "padded), rotary (the default)", reference)
    hf = targets.modeling
    ours, hf.apply_rotary_pos_emb_vision = hf.apply_rotary_pos_emb_vision, kernels.stock_vision_rotary(hf)
    tower.measure("  the same with the stock vision rotary (its share)", reference)
    hf.apply_rotary_pos_emb_vision = ours
    padded = [(mlp, mlp.forward) for mlp in plan.swiglu_mlps if kernels.UNPADDED_FORWARD in mlp.__dict__]
    if padded:  # the MLP padded to a multiple of kernels.MLP_ALIGN (in the default above): its share
        for mlp, _ in padded:
            mlp.forward = mlp.__dict__[kernels.UNPADDED_FORWARD]
        tower.measure(f"  the same without the MLP padded to a multiple of {kernels.MLP_ALIGN} (its share)",
                      reference)
        for mlp, forward in padded:
            mlp.forward = forward


def print_profile(tower: Tower, rows: int) -> None:
    """The ``torch.profiler`` table of the largest batch (kernels on a GPU, operators on a CPU), grouped by kind."""
    cuda = tower.device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    largest = tower.largest
    with torch.inference_mode(), torch.profiler.profile(activities=[activity]) as prof:
        tower.run(largest)
        common.sync(tower.device)

    def own_time(e) -> float:  # microseconds: the kernels' on a GPU, the operators' own host time on a CPU
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    events = [e for e in prof.key_averages() if own_time(e) > 0]
    total = sum(own_time(e) for e in events)
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + own_time(e)
    print(f"one batch of {int(largest.pixel_values.shape[0])} patches: {total / 1e3:.1f} ms of "
          f"{'kernels' if cuda else 'operators'}; "
          + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    for e in sorted(events, key=lambda e: -own_time(e))[:rows]:
        print(f"{100 * own_time(e) / total:5.1f}%  {own_time(e) / 1e3:7.2f} ms "
              f"{e.count:5d}x  [{kind_of(e.key)}] {e.key[:110]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=tuple(common.SIZES), default="qwen2_5_vl")
    parser.add_argument("--size", default=None, help="published size: 7b (qwen2_5_vl); 2b or 8b (qwen3_vl)")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--rows", type=int, default=30, help="profiler rows shown")
    parser.add_argument("--tiny", action="store_true", help="the tiny architecture on the CPU (fp32)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("vision_tower.py needs a CUDA GPU (or --tiny)")
        return 2
    common.select_architecture(args.family, args.size)
    device = torch.device("cpu" if args.tiny else "cuda")
    with common.scratch_folder("lychee_tower_") as folder:
        model = inference.build(args.tiny, device, torch.float32 if args.tiny else torch.bfloat16, folder)
        enable_packed_attention(model.base_model)
        common.family().enable_fast_path(model)
        paths = inference.jpeg_files(Path(folder) / "jpegs", "jpeg800", args.pairs, 7)
        pairs = inference.make_pairs(model.processor, args.pairs // 8, 8, 600, 0.5, 448, 7, paths)
        batches = [to_device(batch, device)["packed"] for _, batch in Reranker(model, batch_size=32).batches(pairs)]
        tower = Tower(model, batches, device, common.matmul_tflops(device))
        images = sum(len(p.image_keys or ()) or 1 for p in batches)
        print(f"tower: {tower.params / 1e6:.1f}M params, {len(batches)} batches, {tower.patches} patches "
              f"({tower.patches / images:.0f} per image); rates are matmul FLOPs (2 x tower params x patches) over the "
              f"time, against the measured bf16 matmul rate {tower.matmul_tflops:.3g} TFLOP/s")
        time_steps(tower)
        print_profile(tower, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
