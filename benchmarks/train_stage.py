"""A real training stage end to end, beside the isolated step at the same shape, in one run.

    PYTHONPATH=src python benchmarks/train_stage.py                 # one CUDA GPU: 7B architecture, random weights
    PYTHONPATH=src python benchmarks/train_stage.py --lengths 850   # one text length only (a shorter command)
    PYTHONPATH=src python benchmarks/train_stage.py --tiny          # the same path on a CPU, in a few minutes
    PYTHONPATH=src python benchmarks/train_stage.py --family qwen3_vl --size 2b   # Qwen3-VL-2B (padded batches)

What runs, per text length (~850 and ~1400 tokens per pair, 1 query + 1 document image each):

1. Data: a model-input Parquet table (the contract schema) of generated documents, each with an 800x800
   JPEG (quality 90) on disk; 1 positive + 9 negatives per record; groups of ``--group-size`` (8: 1 + 7).
2. Model: the Qwen2.5-VL-7B architecture with random weights, saved once as a model folder with the built-in
   tiny processor (same special tokens, chat template and image processing as Qwen2.5-VL), no hub.
3. Stage: ``lychee_pipeline.training.stage_launch.run_stage`` -> ``accelerate launch`` -> ``training/train.py``, the path
   the pipeline's stage node takes: JPEGs decoded and collated in DataLoader workers, LoRA r16, bf16,
   ``model.activation_checkpointing: auto`` within ``--memory-budget-gib``. pairs/s from its result.json
   (steps after the first), peak memory as the stage reports it.
4. Isolated step: the same model folder loaded in this process with the same checkpointed layers the stage
   chose, the same collator on the same records, batches already on the device, and the stage's own step
   (``training/step.py``: forward, loss, backward, clipping, fused AdamW with the non-finite skip on the
   device, zero_grad); after warm-up, as many steps as the stage's compared window, with no host
   synchronisation between them (as in the stage).
5. The same window: the stage's rate over its steps ``--window-from``..end (default 11..end: start-up left
   out) from the per-step timings in its result (``timing.per_step``; on CUDA on the device's clock), against
   the isolated step's. Both are attributed by ``training.step_timing.StepTiming``: host time blocked on the
   data loader, host issue time, the loop's tail (read-back, logging, heartbeat), the GPU's span of each step
   and its idle gap before it (CUDA events read back only once completed), Python GC, cudaMalloc calls.

Prints pairs/s of both, the ratio stage / step (target >= 0.95), peak GiB (target <= 40 with auto), the
attribution lines, the collator's host cost per group, and writes ``train_stage.json`` under ``--out``
($OUT). Needs torch, transformers, peft, accelerate, datasets, pyarrow, Pillow, pyyaml; not kedro or mlflow.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORDS, log = common.WORDS, common.log


# ----------------------------------------------------------------------------------------------
# data


def make_jpegs(folder: Path, count: int, side: int, seed: int,
               sizes: list[tuple[int, int]] | None = None) -> list[str]:
    """``count`` distinct JPEGs (quality 90), side x side (or cycling through ``sizes``, (width, height)), that
    look like product photos: a gradient background, a few filled shapes, fine noise (so they do not compress
    to nothing)."""
    import numpy as np
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        width, height = sizes[i % len(sizes)] if sizes else (side, side)
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        yy, xx = yy / height, xx / width
        base = rng.uniform(40, 215, size=3)
        tilt = rng.uniform(-60, 60, size=3)
        pixels = base + tilt * (xx[..., None] * 0.6 + yy[..., None] * 0.4)
        pixels += rng.normal(0, 6, size=(height, width, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x0, y0 = rng.integers(0, width * 3 // 4), rng.integers(0, height * 3 // 4)
            w, h = rng.integers(width // 10, width // 3), rng.integers(height // 10, height // 3)
            colour = tuple(int(c) for c in rng.integers(0, 255, size=3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([int(x0), int(y0), int(x0 + w), int(y0 + h)],
                                                                      fill=colour)
        path = folder / f"doc_{i:04d}_{width}x{height}.jpg"
        image.save(path, quality=90)
        paths.append(str(path))
    return paths


def text_of_tokens(tokenizer, n_tokens: int, rng: torch.Generator) -> str:
    words, count = [], 0
    while count < n_tokens:
        words += [WORDS[int(i)] for i in torch.randint(len(WORDS), (64,), generator=rng)]
        count = len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids).strip()


def write_table(folder: Path, processor, images: list[str], records: int, negatives: int, tokens_per_pair: int,
                max_pixels: int, min_pixels: int, seed: int) -> tuple[Path, list[int]]:
    """Model-input rows whose pairs have ~``tokens_per_pair`` tokens (image tokens included), as the collator
    counts them at ``max_pixels``. Returns the Parquet path and the token counts of the first record's pairs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lychee_pipeline.reranker.collate import PairCollator
    from lychee_pipeline.reranker.prompt import instruction_for

    collator = PairCollator(processor, max_length=8192, min_pixels=min_pixels, max_pixels=max_pixels,
                            family=common.family().NAME)
    rng = torch.Generator().manual_seed(seed)
    instruction = instruction_for("t2it", defaults=common.family().DEFAULT_INSTRUCTIONS)
    query = {"text": text_of_tokens(processor.tokenizer, 16, rng), "image": None}
    overhead = collator.measure((query, {"text": "x", "image": images[0]}, instruction)) - 1
    rows, n_img = [], 0
    for r in range(records):
        query = {"text": text_of_tokens(processor.tokenizer, 16, rng), "image": None}
        docs = []
        for d in range(1 + negatives):
            jitter = 1 + (torch.rand((), generator=rng).item() * 2 - 1) * 0.05
            n_doc = max(4, int(round(tokens_per_pair * jitter)) - overhead)
            doc = {"doc_id": f"r{r}-d{d}", "text": text_of_tokens(processor.tokenizer, n_doc, rng),
                   "image": images[n_img % len(images)], "meta": "{}"}
            n_img += 1
            if d:
                doc["hard"] = d % 2 == 1
            docs.append(doc)
        rows.append({"record_id": f"r{r:05d}", "query": query, "positives": docs[:1], "negatives": docs[1:],
                     "task_type": "t2it", "language": "en", "split": "train"})
    path = folder / "train.parquet"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    first = rows[0]
    counts = [collator.measure((first["query"], d, instruction)) for d in first["positives"] + first["negatives"]]
    return path, counts


# ----------------------------------------------------------------------------------------------
# model folder


def save_model_folder(folder: Path, tiny: bool, device: torch.device, dtype: torch.dtype) -> Path:
    """The selected architecture (7B, 2B, 8B or tiny) with random weights + its family's built-in tiny processor
    (the same special tokens, chat template and image processing), as a model folder."""
    from lychee_pipeline.reranker.families.qwen2_5_vl.recipe import token_ids_of
    from lychee_pipeline.reranker.tiny import TINY_MODELS, ensure_tiny

    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    family = common.family()
    tiny_name = next(name for name, (model_type, _) in TINY_MODELS.items() if model_type == family.NAME)
    load_processor, save_processor = family.load_processor, family.save_processor
    processor = load_processor(str(ensure_tiny(str(folder.parent / f"tiny_processor_{family.NAME}"), tiny_name)))
    config = common.build_config(tiny=tiny, **token_ids_of(processor.tokenizer))
    model = common.build_model(config, device, dtype)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    save_processor(processor, tmp)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


# ----------------------------------------------------------------------------------------------
# the stage and the isolated step


def training_params(args, max_steps: int) -> dict:
    train = dict(
        loss="listwise", temperature=0.05, group_size=args.group_size, per_device_batch_size=1,
        gradient_accumulation_steps=1, learning_rate=1e-4, weight_decay=0.0, warmup_ratio=0.0,
        scheduler="constant", max_grad_norm=1.0, max_nonfinite_steps=max_steps + 1, epochs=1.0,
        max_steps=max_steps, seed=args.seed, max_length=args.max_length, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels, resolution_schedule=[], checkpoint_every=10**6, keep_last=1, resume=False,
        reuse_finished=False, log_every=args.log_every, memory_budget_gib=args.memory_budget_gib,
        dataloader={"num_workers": args.workers if args.workers == "auto" else int(args.workers),
                    "prefetch_factor": "auto", "persistent_workers": "auto", "pin_memory": "auto"},
        launch=dict(strategy="ddp", mixed_precision="auto", num_machines=1, machine_rank=0, main_process_ip=None,
                    main_process_port=None, timeout_s=1800, process_group_timeout_s=600, threads_per_process=1),
    )
    try:  # validated as the pipeline validates it, where pydantic is installed
        from lychee_pipeline.training.config import TrainingParams

        train = TrainingParams(**train).model_dump()
    except ImportError:
        pass
    return train


def lora_fused(args) -> bool | str:
    """``--lora-fused`` as ``model.lora.fused`` takes it."""
    return {"auto": "auto", "true": True, "false": False}[args.lora_fused]


def model_spec(args, folder: Path) -> dict:
    ckpt = "auto" if args.checkpoint_layers == "auto" else True
    layers = None if args.checkpoint_layers == "auto" else int(args.checkpoint_layers)
    return {"name_or_path": str(folder), "finetune": "lora",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.05, "fused": lora_fused(args)},
            "activation_checkpointing": ckpt, "checkpoint_layers": layers, "attn_implementation": "sdpa",
            "fast_path": True, "pack_pairs": args.pack_pairs, "kernels": args.kernels,
            "compile_layers": args.compile_layers}


def budget_refusal(folder: Path, counts: list[int], args, device_type: str) -> str | None:
    """With ``--checkpoint-layers auto``: the one line saying which setting to change when the memory model
    (training/memory.py) predicts that the stage cannot fit ``--memory-budget-gib`` even with every decoder layer
    checkpointed (None when it fits: the stage then plans its layers within the budget itself). The weights are
    the model folder's safetensors (saved in the dtype the stage loads)."""
    from lychee_pipeline.reranker.families import refused
    from lychee_pipeline.reranker.kernels import resolve_kernels
    from lychee_pipeline.training import memory

    if args.checkpoint_layers != "auto":
        return None
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    family = common.family()
    # what the stage will run: pack_pairs/kernels "auto" resolved as the model's load resolves them
    packed = bool(args.pack_pairs) and (args.pack_pairs is True or refused(family, "pack_pairs") is None)
    fused = resolve_kernels(args.kernels, device_type, refused(family, "kernels")) == "liger"
    from lychee_pipeline.reranker.lora_branch import wants_fused

    lora_branch = wants_fused(lora_fused(args), torch.device(device_type))
    costs = memory.activation_costs(packed=packed, fused=fused, lora_branch=lora_branch)
    tokens = memory.longest_micro_batch_tokens(counts, args.group_size, packed=packed)
    choice = memory.choose_checkpoint_layers(tokens, int(text["hidden_size"]), int(text["num_hidden_layers"]),
                                             weight_bytes, args.memory_budget_gib, costs=costs)
    log(f"memory model: {choice.describe()}")
    return memory.over_budget_advice(choice, int(text["hidden_size"]), weight_bytes, args.group_size, costs=costs)


def run_real_stage(args, work: Path, data: Path, folder: Path, device_type: str, label: str) -> dict:
    from lychee_pipeline.training.stage import StageSpec
    from lychee_pipeline.training.stage_launch import run_stage

    spec = {"stage": f"bench_{label}", "data_path": str(data), "output_dir": str(work / f"stage_{label}"),
            "model": model_spec(args, folder), "training": training_params(args, args.stage_steps)}
    t0 = time.perf_counter()
    result = run_stage(work / f"stage_{label}", StageSpec.model_validate(spec), 1, device_type).model_dump()
    result["stage_wall_s_incl_launch_and_load"] = time.perf_counter() - t0
    return result


def isolated_step(args, data: Path, folder: Path, device: torch.device, layers: int, steps: int) -> dict:
    """The stage's step without the stage: same model folder, collator, records, checkpointed layers; inputs
    collated beforehand and already on the device. Timed as the stage is: ``steps`` steps after warm-up with
    no host synchronisation between them (one before, one after), attributed by the same
    :class:`~lychee_pipeline.training.step_timing.StepTiming`."""
    import datasets

    from lychee_pipeline.reranker import GroupCollator, ModelConfig, load_reranker
    from lychee_pipeline.reranker.losses import LossOptions, get_loss
    from lychee_pipeline.training.step import MicroBatch, OneProcess, TrainStep
    from lychee_pipeline.training.step_timing import StepTiming

    records = datasets.Dataset.from_parquet(str(data))
    cfg = ModelConfig(**{k: v for k, v in model_spec(args, folder).items()
                         if k in {f.name for f in dataclasses.fields(ModelConfig)}} | {"activation_checkpointing": False})
    t0 = time.perf_counter()
    reranker = load_reranker(cfg, device)
    load_s = time.perf_counter() - t0
    reranker.family.apply_selective_checkpointing(reranker, layers=layers)
    collator = GroupCollator(reranker.processor, group_size=args.group_size, max_length=args.max_length,
                             min_pixels=args.min_pixels, max_pixels=args.max_pixels, seed=args.seed,
                             family=reranker.family.NAME)
    groups, collate_times = [], []
    for i in range(args.step_groups):
        t1 = time.perf_counter()
        batch = collator([records[i]])
        collate_times.append(time.perf_counter() - t1)
        groups.append(MicroBatch.unweighted(common.to_device(batch, device)))  # its token count read here
    tokens = statistics.mean(g.tokens for g in groups) / args.group_size
    trainable = [p for p in reranker.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    reranker.train()

    def forward(**inputs) -> torch.Tensor:  # the forward in bf16, as the stage's prepared model runs it
        with autocast:
            return reranker(**inputs)

    # The stage's step (training/step.py) on one process: its loss, clipping, fused AdamW with the non-finite
    # skip decided on the device, zero_grad.
    step = TrainStep(OneProcess(device), forward, optimizer, None, trainable, get_loss("listwise"),
                     LossOptions(args.group_size, 0.05), max_grad_norm=1.0, skip_on_device=True)

    common.reset_peak(device)
    for i in range(args.step_warmup):
        step(groups[i % len(groups)])
    timing = StepTiming(device)
    common.sync(device)
    t0 = time.perf_counter()
    for n, group in enumerate(timing.batches(groups[i % len(groups)] for i in range(steps)), start=1):
        step(group)
        timing.step_issued(n)
    common.sync(device)
    wall = time.perf_counter() - t0
    timing.close()
    rows = timing.per_step()
    device_walls = [r[4] + r[5] for r in rows if r[4] is not None and r[5] is not None]
    med = statistics.median(device_walls) / 1e3 if device_walls else statistics.median(r[3] for r in rows) / 1e3
    out = {"pairs_per_s": steps * args.group_size / wall, "mean_step_s": wall / steps, "median_step_s": med,
           "steps": steps, "peak_gib": common.peak_gib(device),
           "tokens_per_pair": tokens, "checkpoint_layers": layers, "model_load_s": load_s,
           "collate_ms_per_group": 1e3 * statistics.median(collate_times),
           # the same attribution as the stage's; step 1 carries no gap (nothing before it was timed)
           "timing": timing.summary(2, pairs_per_step=args.group_size) | {"per_step": rows}}
    del reranker, optimizer, groups, trainable, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def stage_window(stage: dict, args) -> dict:
    """The stage's timing over steps ``--window-from``..end, from its result's per-step rows; pairs/s on the
    device's clock on CUDA (exact over any window), else on the host's."""
    from lychee_pipeline.training.step_timing import summarize

    timing = stage.get("timing") or {}
    window = summarize(timing.get("per_step", []), args.window_from, pairs_per_step=args.group_size)
    if "pairs_per_s" not in window:  # no per-step rows (an older train.py): the whole run's rate
        window = {"first_step": 2, "last_step": stage["steps"], "steps": stage["steps"] - 1,
                  "pairs_per_s": stage["pairs_per_s"]}
    for key in ("gc_ms_total", "gc_collections", "allocator", "readbacks", "readback_ms_mean", "heartbeat_ms_total"):
        if key in timing:
            window[f"run_{key}"] = timing[key]  # over the stage's steps 2-end
    return window


def fmt(value, width: int = 6) -> str:
    return f"{value:{width}.1f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def describe_timing(t: dict) -> str:
    """One line: where a step's time goes (means in ms over the window)."""
    parts = [f"{t['pairs_per_s']:.2f} pairs/s" if "pairs_per_s" in t else None]
    for key, name in (("step_wall_ms", "host step"), ("device_step_wall_ms", "device step"),
                      ("data_wait_ms", "data wait"), ("issue_ms", "issue"), ("tail_ms", "tail"),
                      ("gpu_step_ms", "GPU span"), ("gpu_gap_ms", "GPU gap")):
        if t.get(key) is not None:
            parts.append(f"{name} {t[key]:.1f} ms")
    for key, name in (("gpu_busy_share", "GPU busy"), ("host_blocked_on_data_share", "host blocked on data")):
        if t.get(key) is not None:
            parts.append(f"{name} {100 * t[key]:.0f}%")
    for prefix in ("run_", ""):
        if f"{prefix}gc_ms_total" in t:
            parts.append(f"GC {t[f'{prefix}gc_ms_total']:.0f} ms in {t[f'{prefix}gc_collections']} collections")
        if f"{prefix}allocator" in t:
            a = t[f"{prefix}allocator"]
            parts.append(f"cudaMalloc {a.get('device_alloc')} / cudaFree {a.get('device_free')} after step "
                         f"{a.get('from_step')}")
        if t.get(f"{prefix}readbacks"):
            parts.append(f"{t[f'{prefix}readbacks']} read-backs of {t[f'{prefix}readback_ms_mean']:.1f} ms")
    return ", ".join(p for p in parts if p)


# ----------------------------------------------------------------------------------------------


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny architecture on a CPU (the same code path)")
    parser.add_argument("--lengths", default=None, help="tokens per pair, comma-separated (default 850,1400; "
                                                        "tiny 120,200)")
    parser.add_argument("--group-size", type=int, default=None, help="pairs per group (default 8; tiny 4)")
    parser.add_argument("--records", type=int, default=None, help="records per table (default stage steps + 8)")
    parser.add_argument("--stage-steps", type=int, default=None, help="optimizer steps of each stage (default 30; "
                                                                       "tiny 8)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-groups", type=int, default=6, help="distinct groups of the isolated step")
    parser.add_argument("--step-warmup", type=int, default=2)
    parser.add_argument("--step-steps", type=int, default=None, help="timed isolated steps (default: as many as the "
                                                                      "stage's window)")
    parser.add_argument("--window-from", type=int, default=None,
                        help="first stage step of the compared window (default 11 from 30 stage steps, else 2): "
                             "leaves out start-up (workers, allocator, first read-backs)")
    parser.add_argument("--workers", default="auto", help="training.dataloader.num_workers of the stage")
    parser.add_argument("--checkpoint-layers", default="auto", help="auto (the memory budget picks) or a count")
    parser.add_argument("--memory-budget-gib", type=float, default=40.0,
                        help="training.memory_budget_gib of the stage (auto checkpointing plans within it); where the "
                             "memory model predicts no fit even with every layer checkpointed, one line says which "
                             "setting to change and the stage is not run")
    parser.add_argument("--no-step", action="store_true", help="leave the isolated step out (the stage against the "
                        "memory budget alone, e.g. --memory-budget-gib 22, 38, 70 in less device time)")
    parser.add_argument("--pack-pairs", action=argparse.BooleanOptionalAction, default="auto",
                        help="model.pack_pairs (the project's default: auto, packed where the family holds it)")
    parser.add_argument("--kernels", choices=("auto", "liger", "none"), default="auto",
                        help="model.kernels (the project's default: auto)")
    parser.add_argument("--lora-fused", choices=("auto", "true", "false"), default="auto",
                        help="model.lora.fused: the one-function LoRA branch (auto = on CUDA) or peft's forward")
    parser.add_argument("--compile-layers", action="store_true", help="model.compile_layers: torch.compile the layers")
    parser.add_argument("--max-pixels", type=int, default=None, help="default 448*448 (tiny 112*112)")
    parser.add_argument("--min-pixels", type=int, default=3136)
    parser.add_argument("--max-length", type=int, default=3200)
    parser.add_argument("--image-side", type=int, default=800)
    parser.add_argument("--work-dir", type=Path, default=None, help="model folder, data, stages (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    common.add_run_args(parser, seed=11)
    return parser


def print_summary(results: dict, args, env: dict, device: torch.device) -> bool:
    """The table of the lengths, stage against isolated step; whether every length met the targets."""
    log("")
    log(f"train_stage summary ({env.get('gpu')}, torch {env['torch']}, transformers {env['transformers']}, "
        f"{common.architecture_name(args.tiny)} architecture, random weights, LoRA r16, groups of {args.group_size}, "
        f"{args.image_side}x{args.image_side} JPEG per document, max_pixels {args.max_pixels})")
    log(f"stage p/s: steps {args.window_from}-{args.stage_steps} of the stage; step p/s: {args.step_steps} isolated "
        f"steps; data / gap: the stage's mean data-loader wait (host) and device idle between steps, ms")
    log(f"{'length':>8} {'tok/pair':>8} {'stage p/s':>10} {'step p/s':>9} {'ratio':>6} {'data':>6} {'gap':>6} "
        f"{'stage GiB':>10} {'step GiB':>9} {'ckpt':>5}  verdict")
    ok_all = True
    for label, r in results["lengths"].items():
        if "refused" in r:
            log(f"{label:>8} not run: {r['refused']}")
            continue
        stage_peak = max(r["stage"]["peak_mem_gib"])
        if r.get("step") is None:  # --no-step: the stage against the budget alone
            ok = stage_peak <= args.memory_budget_gib or device.type != "cuda"
            ok_all &= ok
            ckpt = (r["stage"].get("activation_checkpointing") or {}).get("layers", "?")
            log(f"{label:>8} stage {r['stage_window']['pairs_per_s']:.2f} pairs/s, peak {stage_peak:.1f} GiB, "
                f"{ckpt} layers checkpointed: {'within' if ok else 'OVER'} the {args.memory_budget_gib:.0f} GiB budget")
            continue
        ok = r["ratio_stage_over_step"] >= 0.95 and (stage_peak <= args.memory_budget_gib or device.type != "cuda")
        ok_all &= ok
        w = r["stage_window"]
        log(f"{label:>8} {r['step']['tokens_per_pair']:8.0f} {w['pairs_per_s']:10.2f} "
            f"{r['step']['pairs_per_s']:9.2f} {r['ratio_stage_over_step']:6.2f} {fmt(w.get('data_wait_ms'))} "
            f"{fmt(w.get('gpu_gap_ms'))} {stage_peak:10.1f} "
            f"{r['step']['peak_gib']:9.1f} {r['step']['checkpoint_layers']:>5}  "
            f"{'target met' if ok else 'TARGET MISSED'} (stage >= 0.95 x step, peak <= {args.memory_budget_gib:.0f} GiB)")
    if device.type != "cuda":
        log("(CPU: peak is the process's max RSS in GiB; the targets are for one H200)")
    return ok_all


def compare_with_step(args, stage: dict, window: dict, data: Path, folder: Path, device: torch.device,
                      layers: int) -> dict:
    """The isolated step at the stage's shape and checkpointed layers, and the stage's rate against it."""
    step = isolated_step(args, data, folder, device, layers, args.step_steps)
    ratio = window["pairs_per_s"] / step["pairs_per_s"]
    log(f"isolated step: {step['pairs_per_s']:.2f} pairs/s over {step['steps']} steps without a sync between "
        f"them (mean {1e3 * step['mean_step_s']:.0f} ms, median {1e3 * step['median_step_s']:.0f} ms), "
        f"peak {step['peak_gib']:.1f} GiB, {step['tokens_per_pair']:.0f} tokens/pair, "
        f"collator {step['collate_ms_per_group']:.0f} ms/group on this host (one process)")
    log(f"isolated step, steps 2-{step['steps']}: {describe_timing(step['timing'])}")
    log(f"stage / isolated step over {window['steps']} vs {step['steps']} steps: {ratio:.2f} "
        f"(stage steps 2-{stage['steps']}: {stage['pairs_per_s'] / step['pairs_per_s']:.2f})")
    return {"step": step, "ratio_stage_over_step": ratio,
            "ratio_all_stage_steps_over_step": stage["pairs_per_s"] / step["pairs_per_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    device, dtype = common.pick_device(parser, args)
    tiny = args.tiny
    lengths = [int(x) for x in (args.lengths or ("120,200" if tiny else "850,1400")).split(",") if x.strip()]
    args.group_size = args.group_size or (4 if tiny else 8)
    args.stage_steps = args.stage_steps or (8 if tiny else 30)
    args.window_from = args.window_from or (11 if args.stage_steps >= 30 else 2)
    if args.window_from > args.stage_steps:
        parser.error(f"--window-from {args.window_from} is past the stage's {args.stage_steps} steps")
    args.step_steps = args.step_steps or (args.stage_steps - args.window_from + 1)
    args.max_pixels = args.max_pixels or ((112 * 112) if tiny else (448 * 448))
    records = args.records or (args.stage_steps + 8)
    if device.type == "cpu":  # as the stage's processes (training.launch.threads_per_process: 1)
        torch.set_num_threads(1)
    env = common.environment(device)
    from lychee_pipeline.host import cpus_available

    env["cpus"] = str(cpus_available())
    log(f"env {json.dumps(env)}")
    with common.scratch_folder("lychee_stage_bench_", args.work_dir, keep=args.keep) as work:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)

        t0 = time.perf_counter()
        arch = common.architecture_name(tiny).replace(" ", "_")
        folder = save_model_folder(work / f"model_{arch}", tiny, device, dtype)
        log(f"model folder {folder} ready in {time.perf_counter() - t0:.1f} s")
        processor = common.family().load_processor(str(folder))
        t0 = time.perf_counter()
        images = make_jpegs(work / "images", 48, args.image_side, args.seed)
        log(f"{len(images)} JPEGs of {args.image_side}x{args.image_side} in {time.perf_counter() - t0:.1f} s "
            f"({sum(Path(p).stat().st_size for p in images) / len(images) / 1024:.0f} KiB each)")

        results: dict = {"env": env, "args": {k: str(v) for k, v in vars(args).items()}, "lengths": {}}
        for length in lengths:
            label = f"{length}tok"
            data, counts = write_table(work / f"data_{label}", processor, images, records, 9, length, args.max_pixels,
                                       args.min_pixels, args.seed + length)
            log(f"\n== {length} tokens/pair: {records} records, first group's pairs {min(counts)}-{max(counts)} tokens")
            refusal = budget_refusal(folder, counts, args, device.type)
            if refusal is not None:  # the stage would not fit: say what to change instead of running out of memory
                log(refusal)
                results["lengths"][label] = {"refused": refusal}
                continue
            stage = run_real_stage(args, work, data, folder, device.type, label)
            choice = stage.get("activation_checkpointing")
            layers = choice["layers"] if isinstance(choice, dict) else (
                int(args.checkpoint_layers) if args.checkpoint_layers != "auto" else 0)
            peak_stage = max(stage["peak_mem_gib"])
            log(f"stage: {stage['pairs_per_s']:.2f} pairs/s over steps 2-{stage['steps']}, peak {peak_stage:.1f} GiB, "
                f"checkpointing {json.dumps(choice)}, data loader {stage.get('dataloader')}, "
                f"wall incl. launch and load {stage['stage_wall_s_incl_launch_and_load']:.0f} s, "
                f"loss {stage['losses'][0][1]:.4f} -> {stage['final_loss']:.4f}")
            window = stage_window(stage, args)
            log(f"stage, steps {window.get('first_step')}-{window.get('last_step')}: {describe_timing(window)}")
            results["lengths"][label] = {
                "stage": {k: stage[k] for k in ("pairs_per_s", "peak_mem_gib", "steps", "wall_time_s", "final_loss",
                                                "truncation", "dataloader", "activation_checkpointing",
                                                "stage_wall_s_incl_launch_and_load", "timing") if k in stage},
                "stage_window": window, "stage_losses": stage["losses"], "step": None,
            }
            if not args.no_step:
                results["lengths"][label].update(compare_with_step(args, stage, window, data, folder, device, layers))

        results["targets_met"] = print_summary(results, args, env, device)
        if args.out is not None:
            (args.out / ("train_stage_tiny.json" if tiny else "train_stage.json")).write_text(
                json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
