"""Inference benchmark on the Qwen2.5-VL-7B architecture (random weights, bf16): the reranker core's
batched scoring (``Reranker.score_pairs``) against a naive loop, on the same 512 pairs.

    PYTHONPATH=src python benchmarks/inference.py           # CUDA GPU
    PYTHONPATH=src python benchmarks/inference.py --tiny    # the same code paths on a CPU
    PYTHONPATH=src python benchmarks/inference.py --family qwen3_vl --size 8b   # Qwen3-VL-8B, padded batches

Pairs: 64 queries x 8 documents; each pair ~600 text tokens +-50% and one 448x448 document image
(256 visual tokens), fixed seed. Text goes through the project's processor and collator: the
built-in tiny model's tokenizer and image processor (same special tokens, chat template and image
processing as Qwen2.5-VL), with the 7B architecture's token ids set to that tokenizer's.

* ``naive``: batches of 8 in input order, padded, the stock Hugging Face forward with full logits;
* ``core``:  ``Reranker(model, batch_size=B).score_pairs`` (length-sorted batches, last-position
             yes/no logits) with the fast vision path (``qwen2_5_vl.enable_fast_path``);
* ``core-nofast`` (``--attribute``): the same without the fast vision path.

Timed end to end (prompt building, image processing, forward, scores back on the host), after a
warm-up. Scores are compared with the naive loop's, and so are the per-query rankings.

``--images jpeg800`` / ``--images mixed``: documents are JPEG *file paths* (quality 90) as a user's data has
them: all 800x800, or mixed sizes (400x300 .. 3000x2000, portrait and landscape), decoded at scoring time;
default pixel budget (1280·28·28), 48 queries x 8 documents. Reported: ``core`` end to end (host thread
preparing ahead), ``core-serial`` (the same, host work in line: ``prefetch_batches=0``), ``gpu-only`` (the
same batches encoded beforehand and already on the device: forward + scores only) and the ``naive`` loop;
targets: core >= 0.95 x gpu-only and >= 2.5 x naive. The core line also says when its first forward started
(the device's idle time at the start), the first batch's size and the host phases summed over the preparing
threads; ``--previous`` adds ``core-previous``: the core with one preparing thread and no first-batch split
(the earlier host pipeline; scores read back the new way), on the same pairs in the same run.

    PYTHONPATH=src python benchmarks/inference.py --images jpeg800
    PYTHONPATH=src python benchmarks/inference.py --images mixed
    PYTHONPATH=src python benchmarks/inference.py --images jpeg800 --tiny --queries 6   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from lychee_pipeline.reranker.families import refused  # noqa: E402
from lychee_pipeline.reranker.families.qwen2_5_vl.recipe import token_ids_of  # noqa: E402
from lychee_pipeline.reranker.collate import PairCollator  # noqa: E402
from lychee_pipeline.reranker.inference import Reranker, to_device  # noqa: E402
from lychee_pipeline.reranker.kernels import apply_kernels  # noqa: E402
from lychee_pipeline.reranker.model import LycheeReranker, ModelConfig, single_token_id  # noqa: E402
from lychee_pipeline.reranker import packing  # noqa: E402
from lychee_pipeline.reranker.packing import enable_packed_attention  # noqa: E402
from lychee_pipeline.reranker.prefix import resolve_prefix_reuse  # noqa: E402
from lychee_pipeline.reranker.tiny import ensure_tiny  # noqa: E402
from lychee_pipeline.reranker.vision_cache import VisionFeatureCache  # noqa: E402

WORDS, log = common.WORDS, common.log


def make_pairs(processor, n_queries: int, docs_per_query: int, text_tokens: int, jitter: float, side: int, seed: int,
               image_paths: list[str] | None = None, query_images: bool = False):
    """(query, doc) pairs: text-only queries (``query_images``: each with an image too, as a multimodal query has
    it), documents with text and one side x side image (or the next of ``image_paths``, as a path); each pair has
    ``text_tokens`` +- ``jitter`` text tokens in all (prompt template and query included)."""
    from PIL import Image

    tokenizer = processor.tokenizer
    collator = PairCollator(processor, family=common.family().NAME)

    rng = torch.Generator().manual_seed(seed)

    def text_of(n_tokens: int) -> str:
        words, count = [], 0
        while count < n_tokens:
            chunk = [WORDS[int(i)] for i in torch.randint(len(WORDS), (32,), generator=rng)]
            words += chunk
            count = len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])
        text = " ".join(words)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
        return tokenizer.decode(ids)

    def query_image(q: int):
        if not query_images:
            return None
        if image_paths:
            return image_paths[(q * 7 + 3) % len(image_paths)]
        return Image.fromarray((torch.rand(side, side, 3, generator=rng) * 255).to(torch.uint8).numpy())

    pairs = []
    for q in range(n_queries):
        query = {"text": text_of(20), "image": query_image(q)}
        # text tokens of the prompt without document text: template, instruction, query, vision start/end
        overhead = collator.prepare((query, {"text": "x", "image": None}))[2] + 1
        for d in range(docs_per_query):
            factor = 1 + (torch.rand((), generator=rng).item() * 2 - 1) * jitter
            n_doc = max(8, int(round(text_tokens * factor)) - overhead)
            if image_paths:
                image = image_paths[(q * docs_per_query + d) % len(image_paths)]
            else:
                image = Image.fromarray((torch.rand(side, side, 3, generator=rng) * 255).to(torch.uint8).numpy())
            doc = {"text": text_of(n_doc), "image": image}
            pairs.append((query, doc))
    return pairs


def build(tiny: bool, device: torch.device, dtype: torch.dtype, tiny_dir: str) -> LycheeReranker:
    family = common.family()
    processor = family.load_processor(str(ensure_tiny(str(Path(tiny_dir) / family.NAME), common.tiny_name())))
    tok = processor.tokenizer
    ids = token_ids_of(tok)
    model = common.build_model(common.build_config(tiny=tiny, **ids), device, dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    # packing is switched on after the naive loop, where the family holds it
    cfg = ModelConfig(name_or_path=f"random:{common.architecture_name(tiny)}", finetune="frozen",
                      pack_pairs=refused(family, "pack_pairs") is None)
    reranker = LycheeReranker(model, processor, cfg, single_token_id(tok, "yes"), single_token_id(tok, "no"))
    reranker.eval()
    return reranker


@torch.inference_mode()
def naive_scores(reranker: LycheeReranker, pairs, batch_size: int = 8) -> list[float]:
    """Batches of ``batch_size`` in input order, padded, full-vocabulary logits, p(yes) from the last position."""
    collator = PairCollator(reranker.processor, family=reranker.family.NAME)
    device = reranker.device
    scores: list[float] = []
    for start in range(0, len(pairs), batch_size):
        batch = collator(pairs[start : start + batch_size])
        inputs = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        logits = reranker.base_model(**inputs, use_cache=False, return_dict=True).logits
        z = logits[:, -1, [reranker.yes_id, reranker.no_id]].float()
        scores += torch.softmax(z, dim=-1)[:, 0].cpu().tolist()
    return scores


def instrument(collator) -> dict:
    """Wrap ``prepare`` / ``encode`` of a collator instance with wall-clock timers."""
    acc = {"prepare_s": 0.0, "decode_s": 0.0, "encode_s": 0.0}
    for name in ("prepare", "decode", "encode"):
        original = getattr(collator, name)

        def wrapped(*a, _orig=original, _key=f"{name}_s", **kw):
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                acc[_key] += time.perf_counter() - t0

        setattr(collator, name, wrapped)
    return acc


def instrument_all(scorer: Reranker) -> dict:
    """:func:`instrument` on the scorer's collator and on each preparing thread's own collator, summed (host
    seconds across threads, so with several threads more than the wall time they take)."""
    workers = scorer.preparation.threads()
    collators = [scorer.collator] + (scorer.preparation.worker_collators(workers) if workers > 1 else [])
    parts = [instrument(c) for c in collators]
    total = {}

    def summed() -> dict:
        for key in parts[0]:
            total[key] = sum(p[key] for p in parts)
        return total

    total["sum"] = summed
    return total


def first_forward_clock(model) -> dict:
    """Host clock of the model's next forward call (when the device gets its first work of a scoring call)."""
    seen: dict = {}

    def hook(module, args, kwargs):
        seen.setdefault("t", time.perf_counter())

    seen["handle"] = model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def timed(fn, device: torch.device):
    common.sync(device)
    t0 = time.perf_counter()
    out = fn()
    common.sync(device)
    return out, time.perf_counter() - t0


@torch.inference_mode()
def gpu_only(scorer: Reranker, pairs, device: torch.device) -> tuple[list[float], float, int, float | None]:
    """The scorer's own batches, encoded beforehand and moved to the device; times forward + scores only (with the
    scorer's vision cache, empty at the start)."""
    encoded = [(pos, to_device(batch, device)) for pos, batch in scorer.batches(pairs)]
    cache = None if scorer.vision_cache is None else VisionFeatureCache(scorer.vision_cache.max_bytes)
    common.sync(device)
    model = scorer.model
    out = [0.0] * len(pairs)
    t0 = time.perf_counter()
    results = [(pos, model.probabilities(model(**batch, vision_cache=cache))) for pos, batch in encoded]
    for pos, probs in results:
        for i, p in zip(pos, probs.float().cpu().tolist()):
            out[i] = float(p)
    common.sync(device)
    secs = time.perf_counter() - t0
    n_batches = len(encoded)
    vision_secs = vision_tower_seconds(model, [batch for _, batch in encoded], device)
    del encoded, results
    return out, secs, n_batches, vision_secs


def vision_tower_seconds(model, batches: list[dict], device: torch.device) -> float | None:
    """Attribution: the vision tower alone on the same packed batches (its share of the forward above), or None
    where the batches are not packed or carry no image."""
    packed = [b["packed"] for b in batches if isinstance(b.get("packed"), packing.PackedBatch)
              and b["packed"].pixel_values is not None]
    if not packed:
        return None
    vl_model = model.base_model.model
    common.sync(device)
    t0 = time.perf_counter()
    for p in packed:
        vl_model.get_image_features(p.pixel_values, p.image_grid_thw, return_dict=True, **p.vision_to_device,
                                    **p.vision_on_host)
    common.sync(device)
    return time.perf_counter() - t0


def jpeg_files(folder: Path, kind: str, count: int, seed: int) -> list[str]:
    from train_stage import make_jpegs

    if kind == "jpeg800":
        return make_jpegs(folder, count, 800, seed)
    sizes = [(800, 800), (400, 300), (1600, 1200), (1200, 1600), (3000, 2000), (640, 960), (2048, 1536), (1024, 768)]
    return make_jpegs(folder, count, 800, seed, sizes=sizes)


def rankings(scores: list[float], per_query: int) -> list[list[int]]:
    return [sorted(range(per_query), key=lambda i: -scores[q + i]) for q in range(0, len(scores), per_query)]


def compare(ref: list[float], other: list[float], per_query: int) -> dict:
    import math

    diffs = [abs(a - b) for a, b in zip(ref, other)]
    logit = [math.log(max(p, 1e-12) / max(1 - p, 1e-12)) for p in ref]
    logit_o = [math.log(max(p, 1e-12) / max(1 - p, 1e-12)) for p in other]
    r1, r2 = rankings(ref, per_query), rankings(other, per_query)
    same = sum(a == b for a, b in zip(r1, r2))
    top1 = sum(a[0] == b[0] for a, b in zip(r1, r2))
    # smallest gap between neighbouring scores of a query in the reference (how close the ties are)
    gaps = []
    for q in range(0, len(ref), per_query):
        s = sorted(ref[q : q + per_query])
        gaps += [b - a for a, b in zip(s[:-1], s[1:])]
    # doc pairs ordered differently, and the largest reference logit gap among them
    discordant, worst_gap = 0, 0.0
    for q in range(0, len(ref), per_query):
        for i in range(per_query):
            for j in range(i + 1, per_query):
                a = logit[q + i] - logit[q + j]
                b = logit_o[q + i] - logit_o[q + j]
                if a * b < 0 or (a == 0) != (b == 0):
                    discordant += 1
                    worst_gap = max(worst_gap, abs(a))
    return {
        "discordant_doc_pairs": discordant,
        "doc_pairs": len(r1) * per_query * (per_query - 1) // 2,
        "max_ref_logit_gap_of_discordant": worst_gap,
        "max_abs_prob_diff": max(diffs),
        "mean_abs_prob_diff": statistics.mean(diffs),
        "max_abs_logit_diff": max(abs(a - b) for a, b in zip(logit, logit_o)),
        # issue 34's parity yardstick: the stock forward's own batch-to-batch bf16 differences, median ~0.055
        "median_abs_logit_diff": statistics.median(abs(a - b) for a, b in zip(logit, logit_o)),
        "queries_same_ranking": same,
        "queries_same_top1": top1,
        "queries": len(r1),
        "min_neighbour_gap_ref": min(gaps) if gaps else float("nan"),
    }


class WorkCounter:
    """Tokens and vision patches the model actually runs, summed over forwards: a packed batch's tokens (with
    shared prefixes, each prefix once) or a padded batch's rows x longest row, and the patches the vision tower
    takes (counted at the tower, so images whose features come from the vision cache are not counted)."""

    def __init__(self, *modules):
        self.tokens = self.patches = 0
        towers = {id(m): m for root in modules for name, m in root.named_modules() if name.split(".")[-1] == "visual"}
        self.handles = [m.register_forward_pre_hook(self.count_tokens, with_kwargs=True) for m in modules]
        self.handles += [m.register_forward_pre_hook(self.count_patches, with_kwargs=True) for m in towers.values()]

    def count_tokens(self, module, args, kwargs):
        packed = kwargs.get("packed")
        self.tokens += packed.tokens if packed is not None else int(kwargs["input_ids"].numel())

    def count_patches(self, module, args, kwargs):
        pixels = args[0] if args else kwargs.get("hidden_states", kwargs.get("pixel_values"))
        self.patches += int(pixels.shape[0])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def rates(pairs: int, seconds: float, work: WorkCounter, params: tuple[int, int], peaks: dict) -> dict:
    """pairs/s, tokens/s (tokens the model ran) and MFU: forward-only FLOPs 2 x LM params x tokens + 2 x vision
    params x patches over each named peak (the measured bf16 matmul rate, the datasheet's)."""
    n_lm, n_vis = params
    flops = 2 * n_lm * work.tokens + 2 * n_vis * work.patches
    out = {"pairs_per_s": pairs / seconds, "seconds": seconds, "tokens_run": work.tokens,
           "tokens_per_s": work.tokens / seconds, "patches_run": work.patches}
    out.update({f"mfu_{name}": common.mfu(flops / seconds, tflops) for name, (tflops, _) in peaks.items()})
    return out


def timed_with_work(fn, device: torch.device, model, pairs: int, params: tuple[int, int], peaks: dict,
                    *extra_modules) -> tuple[list[float], dict]:
    """``fn()`` timed, with the tokens and patches the model ran counted: (its scores, :func:`rates`)."""
    work = WorkCounter(model, *extra_modules)
    try:
        out, secs = timed(fn, device)
    finally:
        work.remove()
    return out, rates(pairs, secs, work, params, peaks)


def warm_up(scorer: Reranker, pairs) -> None:
    """A short scoring call (kernels, allocator, threads), its vision cache then emptied: the timed call starts
    with none of its images seen."""
    scorer.score_pairs(pairs[:16])
    if scorer.vision_cache is not None:
        scorer.vision_cache = VisionFeatureCache(scorer.vision_cache.max_bytes)


def cache_note(scorer: Reranker) -> str:
    reuse = ", prefix reuse" if scorer.prefix_reuse else ""
    if scorer.vision_cache is None:
        return f"{reuse}, no vision cache"
    stats = scorer.vision_cache.stats()
    return (f"{reuse}, vision cache {stats['max_bytes'] / 2**30:.1f} GiB: {stats['through_tower']} of "
            f"{stats['images']} images through the tower")


def time_core(reranker, pairs, batch_size: int, options: dict, device, params, peaks, label: str) -> dict:
    """One core scorer (``Reranker`` with ``options``) warmed up, then timed over ``pairs`` with its work counted."""
    scorer = Reranker(reranker, batch_size=batch_size, **options)
    warm_up(scorer, pairs)
    common.reset_peak(device)
    scores, r = timed_with_work(lambda: scorer.score_pairs(pairs), device, reranker, len(pairs), params, peaks)
    r.update(peak_gib=common.peak_gib(device), scores=scores, label=label)
    return r


def prefix_variant(reranker, pairs, args, pipeline: dict, device, params, peaks,
                   core_scores: list[float]) -> tuple[str, dict]:
    """The core with prefix reuse the other way from its default (``auto``: on a CUDA GPU, off on a CPU), so the
    run shows it on and off: ``("core-noprefix" or "core-prefix", its rates, tokens and scores against the
    core's)``."""
    core_reuses = resolve_prefix_reuse(pipeline.get("prefix_reuse", "auto"), reranker.prefix_reuse_refusal(),
                                       reranker.device, next(reranker.backbone.parameters()).dtype)
    name = "core-noprefix" if core_reuses else "core-prefix"
    r = time_core(reranker, pairs, args.batch_size, {**pipeline, "prefix_reuse": not core_reuses}, device, params,
                  peaks, f"Reranker.score_pairs(prefix_reuse={not core_reuses}), batch {args.batch_size}"
                  + ("" if core_reuses else ": a query's prefix once a batch"))
    r["vs_core"] = compare(core_scores, r["scores"], args.docs)
    return name, r


def fp8_variants(reranker, pairs, args, pipeline: dict, device, params, peaks, bf16_scores: list[float]) -> dict:
    """``model.fp8`` beside bf16 in the same run: fp32 reference scores on ``--fp8-check`` pairs (the model cast to
    fp32 and back: bf16 -> fp32 -> bf16 is exact); with ``--compile`` the bf16 core with compiled decoder layers
    (the fair baseline: torchao's casts fuse only when compiled); then the language model's projections converted
    to FP8 (torchao; emulated on a CPU, where the rate means nothing) and the core timed. |dlogit| against fp32
    for bf16 and for FP8."""
    from lychee_pipeline.reranker import fp8
    from lychee_pipeline.reranker.kernels import compile_decoder_layers

    sub = pairs[: args.fp8_check]
    def tensors():
        return [*reranker.named_parameters(), *reranker.named_buffers()]

    dtypes = {name: t.dtype for name, t in tensors()}  # per tensor: buffers kept in fp32 stay so
    reranker.to(torch.float32)
    fp32 = Reranker(reranker, batch_size=args.batch_size, **pipeline).score_pairs(sub)
    for name, tensor in tensors():  # .to() replaced the buffers: cast back what the module holds now
        tensor.data = tensor.data.to(dtypes[name])
    out = {"bf16_vs_fp32": compare(fp32, bf16_scores[: len(sub)], args.docs)}
    refusal = fp8.fp8_refusal(device, "frozen")
    if refusal is not None and device.type == "cuda":
        out["skipped"] = refusal
        return out
    emulated = device.type != "cuda"
    if args.compile:
        compile_decoder_layers(reranker.backbone)
        out["core-compiled"] = time_core(reranker, pairs, args.batch_size, pipeline, device, params, peaks,
                                         f"the core, bf16, compiled decoder layers, batch {args.batch_size}")
    count = fp8.apply_fp8(reranker.backbone, reranker.family.language_models(reranker.backbone), emulate=emulated)
    r = time_core(reranker, pairs, args.batch_size, pipeline, device, params, peaks,
                  f"the core with model.fp8 ({count} Float8Linear{', EMULATED on the CPU' if emulated else ''}"
                  f"{', compiled layers' if args.compile else ''}), batch {args.batch_size}")
    r["fp8_vs_fp32"] = compare(fp32, r["scores"][: len(sub)], args.docs)
    out["core-fp8"] = r
    return out


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--docs", type=int, default=8, help="documents per query")
    parser.add_argument("--batch-size", type=int, default=32, help="the core's batch size")
    parser.add_argument("--attribute", action="store_true", help="also time the core without the fast vision path")
    parser.add_argument("--overlap", default="", help="extra batch sizes for the core scorer, e.g. 64,128")
    parser.add_argument("--fast-check", type=int, default=64, help="pairs scored with and without the fast vision path")
    parser.add_argument("--tiny-dir", default=None,
                        help="where the tiny processor and the JPEGs go (kept; default: a temporary folder, removed)")
    parser.add_argument("--images", choices=("memory", "jpeg800", "mixed"), default="memory",
                        help="in-memory 448x448 images (default) or JPEG files: 800x800 or mixed sizes")
    parser.add_argument("--query-images", action="store_true", help="every query has an image too (multimodal "
                        "queries: the prefix a query's candidates share holds its image)")
    parser.add_argument("--text-tokens", type=int, default=None, help="mean text tokens per pair")
    parser.add_argument("--jpeg-count", type=int, default=48, help="distinct JPEG files (cycled over documents)")
    parser.add_argument("--workers", default="auto", help="the core's prepare_workers (host threads; auto: 2 with "
                        "variable-length attention on CUDA and 4 CPUs, else 1)")
    parser.add_argument("--skip-naive", action="store_true", help="leave the naive loop out (the core against "
                        "GPU-only alone, e.g. to compare settings in less device time)")
    parser.add_argument("--first-batch", default="auto", help="the core's first_batch (pairs of a smaller first "
                                                               "batch; auto: batch/4 on a GPU, 0 on a CPU)")
    parser.add_argument("--previous", action="store_true", help="also time the core as it was before the pool and "
                                                                 "the first-batch split (one thread, no split)")
    parser.add_argument("--prefix-reuse", action="store_true", help="also time the core with prefix reuse the other "
                        "way from its default (auto: on a CUDA GPU): core-noprefix there, core-prefix on a CPU")
    parser.add_argument("--vision-cache-gib", default="auto", help="the core's vision_cache_gib (auto, a number of "
                        "GiB, 0: off); when on, core-nocache runs the same core without it")
    parser.add_argument("--fp8", action="store_true", help="last: fp32 reference scores, then the core with "
                        "model.fp8 (core-fp8, torchao float8; Hopper; emulated on a CPU) beside bf16")
    parser.add_argument("--fp8-check", type=int, default=64, help="pairs compared with fp32 for --fp8")
    parser.add_argument("--compile", action="store_true", help="with --fp8: compile the decoder layers, and time "
                        "the bf16 core compiled too (core-compiled) as FP8's baseline")
    common.add_run_args(parser, seed=7)
    return parser


def make_inputs(args, reranker, tiny_dir: str) -> list:
    """The benchmark's pairs (JPEG files written first for --images jpeg800 / mixed)."""
    text_tokens, side = (120, 224) if args.tiny else (600, 448)
    text_tokens = args.text_tokens or text_tokens
    paths = None
    if args.images != "memory":
        if args.queries == 64 and not args.tiny:
            args.queries = 48  # 384 pairs, as in the field measurements
        t0 = time.perf_counter()
        paths = jpeg_files(Path(tiny_dir) / f"jpegs_{args.images}", args.images, args.jpeg_count, args.seed)
        log(f"{len(paths)} {args.images} JPEG files written in {time.perf_counter() - t0:.1f} s "
            f"({sum(Path(p).stat().st_size for p in paths) / len(paths) / 1024:.0f} KiB each)")
    t0 = time.perf_counter()
    pairs = make_pairs(reranker.processor, args.queries, args.docs, text_tokens, 0.5, side, args.seed, paths,
                       args.query_images)
    lengths = [PairCollator(reranker.processor, family=reranker.family.NAME).prepare(p)[2] for p in pairs[:64]]
    log(f"{len(pairs)} pairs made in {time.perf_counter() - t0:.1f} s; tokens/pair incl. image (first 64): mean "
        f"{statistics.mean(lengths):.0f}, min {min(lengths)}, max {max(lengths)}")
    return pairs


def peaks_of(device: torch.device) -> dict:
    """The rates MFU is reported against, named: the bf16 matmul rate measured now, the datasheet's peak."""
    measured = common.matmul_tflops(device)
    return {"measured": (measured, "bf16 8192^3 measured in this run" if device.type == "cuda" else "fp32 CPU"),
            "datasheet": common.datasheet_tflops(device)}


def run_core_variants(args, reranker, pairs, device, params, peaks, ref, pipeline: dict, results: dict,
                      scores: dict) -> None:
    """The core scorer variants (``core`` and those the flags ask for), timed end to end with their host phases."""
    variants = [("core-nofast", args.batch_size, False, pipeline)] if args.attribute else []
    if pipeline["vision_cache_gib"] not in (0, "0", None):
        variants += [("core-nocache", args.batch_size, True, {**pipeline, "vision_cache_gib": 0})]
    variants += [("core", args.batch_size, True, pipeline)]
    if args.previous:
        variants += [("core-previous", args.batch_size, True, {"prepare_workers": 1, "first_batch": 0})]
    for bs in [int(b) for b in args.overlap.split(",") if b.strip()]:
        variants.append((f"core-b{bs}", bs, True, pipeline))
    for name, bs, fast, options in variants:
        common.disable_fast_path(reranker)
        if fast:
            common.family().enable_fast_path(reranker)
        scorer = Reranker(reranker, batch_size=bs, **options)
        warm_up(scorer, pairs)
        phases = instrument_all(scorer)
        common.reset_peak(device)
        first = first_forward_clock(reranker)
        began = time.perf_counter()
        scores[name], r = timed_with_work(lambda: scorer.score_pairs(pairs), device, reranker, len(pairs), params,
                                          peaks)
        first["handle"].remove()
        phases = phases["sum"]()
        bounds = scorer.chunk_bounds(len(pairs))
        results[name] = {**r, "peak_gib": common.peak_gib(device),
                         "host_prepare_s": phases["prepare_s"], "host_decode_s": phases["decode_s"],
                         "host_encode_s": phases["encode_s"], "first_forward_after_s": first["t"] - began,
                         "prepare_workers": scorer.preparation.threads(), "first_chunk": bounds[0][1] if bounds else 0,
                         "batches": sum(-(-(e - s) // bs) for s, e in bounds),
                         "label": f"Reranker.score_pairs, batch {bs} length-sorted, last-position logits"
                                  + (", fast vision" if fast else ", stock vision") + cache_note(scorer),
                         **({"vs_naive": compare(ref, scores[name], args.docs)} if ref is not None else {})}
    if "core-nocache" in scores:
        results["core"]["vs_nocache"] = compare(scores["core-nocache"], scores["core"], args.docs)


def run_device_alone(args, reranker, pairs, device, params, peaks, pipeline: dict, results: dict, scores: dict) -> None:
    """JPEG paths: the core with host work in line (no overlap), and the device alone on the same batches."""
    common.disable_fast_path(reranker)
    common.family().enable_fast_path(reranker)
    serial = Reranker(reranker, batch_size=args.batch_size, prefetch_batches=0, **pipeline)
    common.reset_peak(device)
    scores["core-serial"], r = timed_with_work(lambda: serial.score_pairs(pairs), device, reranker, len(pairs),
                                               params, peaks)
    results["core-serial"] = {**r, "peak_gib": common.peak_gib(device),
                              "label": f"Reranker.score_pairs, batch {args.batch_size}, host work in line "
                                       "(prefetch_batches=0)",
                              "same_scores_as_core": scores["core-serial"] == scores["core"]}
    common.reset_peak(device)
    work = WorkCounter(reranker)
    scores["gpu-only"], secs, n_batches, vision_secs = gpu_only(
        Reranker(reranker, batch_size=args.batch_size, **pipeline), pairs, device)
    work.remove()
    tower = "" if vision_secs is None else (f"; the vision tower alone on them: {vision_secs:.2f} s "
                                            f"({100 * vision_secs / secs:.0f}% of the forward)")
    results["gpu-only"] = {**rates(len(pairs), secs, work, params, peaks), "peak_gib": common.peak_gib(device),
                           "vision_tower_s": vision_secs,
                           "label": f"the same {n_batches} batches encoded beforehand, on the device: forward "
                                    f"only{tower}",
                           "same_scores_as_core": scores["gpu-only"] == scores["core"]}


def variant_line(name: str, r: dict) -> str:
    """One variant's summary line: pairs/s, tokens/s, MFU against both peaks, and what it compared to."""
    extra = ""
    if "vs_naive" in r:
        c = r["vs_naive"]
        extra = (f"  max |dp| {c['max_abs_prob_diff']:.2e}, max |dlogit| {c['max_abs_logit_diff']:.2e} (median "
                 f"{c['median_abs_logit_diff']:.2e}), same ranking "
                 f"{c['queries_same_ranking']}/{c['queries']} queries, same top-1 "
                 f"{c['queries_same_top1']}/{c['queries']}"
                 f"; discordant doc pairs {c['discordant_doc_pairs']}/{c['doc_pairs']}, largest naive logit gap among "
                 f"them {c['max_ref_logit_gap_of_discordant']:.2e}")
    if "host_prepare_s" in r:
        extra += (f"; host prepare {r['host_prepare_s']:.1f} s, image decode {r['host_decode_s']:.1f} s, "
                  f"encode {r['host_encode_s']:.1f} s (summed over {r['prepare_workers']} thread(s)); first "
                  f"forward after {r['first_forward_after_s']:.2f} s (first chunk {r['first_chunk']} pairs, "
                  f"{r['batches']} batches)")
    return (f"{name:>14}: {r['pairs_per_s']:6.2f} pairs/s {r.get('tokens_per_s', float('nan')):8.0f} tok/s MFU "
            f"{100 * r.get('mfu_measured', float('nan')):5.1f}% meas "
            f"{100 * r.get('mfu_datasheet', float('nan')):5.1f}% "
            f"spec ({r['seconds']:.1f} s) peak {r['peak_gib']:.1f} GiB  {r['label']}{extra}")


def print_summary(args, env: dict, peaks: dict, results: dict, n_pairs: int) -> None:
    log("")
    log(f"inference summary ({env.get('gpu')}, torch {env['torch']}, transformers {env['transformers']}), {n_pairs} "
        f"pairs; MFU = forward FLOPs (2 x LM params x tokens run + 2 x vision params x patches) over "
        f"{peaks['measured'][0]:.0f} TFLOP/s ({peaks['measured'][1]}: 'meas') and {peaks['datasheet'][0]:.0f} "
        f"TFLOP/s ({peaks['datasheet'][1]}: 'spec')")
    for name, r in results.items():
        if isinstance(r, dict) and "pairs_per_s" in r:
            log(variant_line(name, r))
    if "fast_vs_stock_vision" in results:
        c = results["fast_vs_stock_vision"]
        log(f"fast vs stock vision path, same scorer, {args.fast_check} pairs: max |dp| {c['max_abs_prob_diff']:.2e}, "
            f"same ranking {c['queries_same_ranking']}/{c['queries']} queries, discordant doc pairs {c['discordant_doc_pairs']}")
    naive = results.get("naive")
    for name, r in list(results.items()):
        if isinstance(r, dict) and "pairs_per_s" in r and name != "naive" and naive is not None:
            log(f"{name} / naive: {r['pairs_per_s'] / naive['pairs_per_s']:.2f}x")
    core = results["core"]
    for variant in ("core-prefix", "core-noprefix"):
        if variant not in results:
            continue
        on, off = (results[variant], core) if variant == "core-prefix" else (core, results[variant])
        c = results[variant]["vs_core"]
        log(f"prefix reuse: {on['pairs_per_s'] / off['pairs_per_s']:.2f}x the core's pairs/s without it; tokens run "
            f"{on['tokens_run']} against {off['tokens_run']} ({100 * (1 - on['tokens_run'] / off['tokens_run']):.1f}% "
            f"saved); {variant} against the core: max |dlogit| {c['max_abs_logit_diff']:.2e}, same ranking "
            f"{c['queries_same_ranking']}/{c['queries']} queries")
    if "core-nocache" in results:
        r = results["core-nocache"]
        log(f"vision cache: {core['pairs_per_s'] / r['pairs_per_s']:.2f}x the uncached core's pairs/s; patches through "
            f"the tower {core['patches_run']} against {r['patches_run']}; against the uncached core: max |dlogit| "
            f"{core['vs_nocache']['max_abs_logit_diff']:.2e}, same ranking {core['vs_nocache']['queries_same_ranking']}"
            f"/{core['vs_nocache']['queries']} queries")
    if "core-fp8" in results or "skipped" in results:
        base = results.get("core-compiled", core)
        b = results["bf16_vs_fp32"]
        line = f"fp8: skipped: {results['skipped']}" if "skipped" in results else (
            f"fp8: {results['core-fp8']['pairs_per_s'] / base['pairs_per_s']:.2f}x the bf16 core's pairs/s "
            f"({'compiled both' if 'core-compiled' in results else 'eager both'}); |dlogit| against fp32 on "
            f"{args.fp8_check} pairs: fp8 max {results['core-fp8']['fp8_vs_fp32']['max_abs_logit_diff']:.3e} "
            f"mean-|dp| {results['core-fp8']['fp8_vs_fp32']['mean_abs_prob_diff']:.3e}, same ranking "
            f"{results['core-fp8']['fp8_vs_fp32']['queries_same_ranking']}/{b['queries']}; bf16 max "
            f"{b['max_abs_logit_diff']:.3e} mean-|dp| {b['mean_abs_prob_diff']:.3e}, same ranking "
            f"{b['queries_same_ranking']}/{b['queries']}")
        log(line)
    speedup = core["pairs_per_s"] / naive["pairs_per_s"] if naive is not None else None
    results["ratio_core_over_naive"] = speedup
    if "gpu-only" in results:
        of_gpu = core["pairs_per_s"] / results["gpu-only"]["pairs_per_s"]
        results["ratio_core_over_gpu_only"] = of_gpu
        met = of_gpu >= 0.95 and (speedup is None or speedup >= 2.5)
        against_naive = "naive not run" if speedup is None else f"{speedup:.2f} x naive (target >= 2.5, aim 3)"
        verdict = ("code path checked (--tiny: the targets are for a GPU)" if args.tiny
                   else "targets met" if met else "TARGETS MISSED")
        log(f"JPEG paths ({args.images}): core end to end = {of_gpu:.2f} x its GPU-only rate (target >= 0.95), "
            f"{against_naive}; core-serial {results['core-serial']['pairs_per_s']:.2f} "
            f"pairs/s; same scores core / serial / gpu-only: {results['core-serial']['same_scores_as_core']} / "
            f"{results['gpu-only']['same_scores_as_core']} -> {verdict}")
    if naive is not None:
        c = core["vs_naive"]
        log(f"core / naive: {speedup:.2f}x; rankings identical for {c['queries_same_ranking']}/{c['queries']} queries "
            f"(smallest neighbour gap in the naive scores {c['min_neighbour_gap_ref']:.2e})")


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    device, dtype = common.pick_device(parser, args)
    env = common.environment(device)
    log(f"env {json.dumps(env)}")
    peaks = peaks_of(device)
    with common.scratch_folder("lychee_tiny_", args.tiny_dir) as tiny_dir:
        return measure(args, device, dtype, env, peaks, str(tiny_dir))


def measure(args, device: torch.device, dtype: torch.dtype, env: dict, peaks: dict, tiny_dir: str) -> int:
    """The naive loop, the core's variants and the checks asked for, on the model built in ``tiny_dir``."""
    t0 = time.perf_counter()
    reranker = build(args.tiny, device, dtype, tiny_dir)
    params = common.count_params(reranker)[:2]
    log(f"model built in {time.perf_counter() - t0:.1f} s; MFU against {peaks['measured'][0]:.3g} TFLOP/s "
        f"({peaks['measured'][1]}) and {peaks['datasheet'][0]:.0f} TFLOP/s ({peaks['datasheet'][1]})")
    pairs = make_inputs(args, reranker, tiny_dir)

    results, scores, ref = {}, {}, None
    if not args.skip_naive:  # naive loop (stock path)
        common.disable_fast_path(reranker)
        naive_scores(reranker, pairs[:16])
        common.reset_peak(device)
        ref, r = timed_with_work(lambda: naive_scores(reranker, pairs), device, reranker.base_model, len(pairs),
                                 params, peaks)
        results["naive"] = {**r, "peak_gib": common.peak_gib(device),
                            "label": "batch 8 in input order, padded, full logits, stock vision"}

    # the core as Reranker.from_pretrained sets a model up by default: fused kernels (model.kernels: auto, liger on
    # CUDA where installed) and packed pairs (model.pack_pairs); the naive loop above ran the stock model
    kernels = apply_kernels(reranker.base_model, "auto", device)
    if reranker.config.pack_pairs:
        enable_packed_attention(reranker.base_model)
        varlen = packing.varlen_attention_ready(device)
        log(f"core set-up: fused kernels {kernels}, pairs packed (the library's defaults), attention over the packed "
            f"pairs: {'one variable-length call per layer' if varlen else 'one SDPA call per pair'}")
    else:
        log(f"core set-up: fused kernels {kernels}, padded batches (the {reranker.family.NAME} family does not pack)")
    pipeline = {"prepare_workers": args.workers if args.workers == "auto" else int(args.workers),
                "first_batch": args.first_batch if args.first_batch == "auto" else int(args.first_batch),
                "vision_cache_gib": args.vision_cache_gib if args.vision_cache_gib == "auto"
                else float(args.vision_cache_gib)}
    run_core_variants(args, reranker, pairs, device, params, peaks, ref, pipeline, results, scores)
    if args.prefix_reuse and refused(reranker.family, "pack_pairs"):
        log(f"--prefix-reuse skipped: prefix reuse runs inside packed batches and the {reranker.family.NAME} family "
            f"does not pack ({refused(reranker.family, 'pack_pairs')})")
    elif args.prefix_reuse:
        name, results[name] = prefix_variant(reranker, pairs, args, pipeline, device, params, peaks, scores["core"])
    if args.images != "memory":
        run_device_alone(args, reranker, pairs, device, params, peaks, pipeline, results, scores)
    if args.fast_check > 0:  # the fast vision path alone: same scorer, same batches, with and without it
        sub = pairs[: args.fast_check]
        common.disable_fast_path(reranker)
        s_stock = Reranker(reranker, batch_size=args.batch_size).score_pairs(sub)
        common.family().enable_fast_path(reranker)
        s_fast = Reranker(reranker, batch_size=args.batch_size).score_pairs(sub)
        results["fast_vs_stock_vision"] = compare(s_stock, s_fast, args.docs)
    if args.fp8:  # last: it converts the model in place
        results.update(fp8_variants(reranker, pairs, args, pipeline, device, params, peaks, scores["core"]))
    print_summary(args, env, peaks, results, len(pairs))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "inference" + ("" if args.images == "memory" else f"_{args.images}") + ("_tiny" if args.tiny else "")
        for r in results.values():
            if isinstance(r, dict):
                r.pop("scores", None)
        (args.out / f"{name}.json").write_text(
            json.dumps({"env": env, "peaks_tflops": peaks, "results": results}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
