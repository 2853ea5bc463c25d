"""Training-step benchmark on the Qwen2.5-VL-7B architecture (random weights, bf16, LoRA r=16 on q/k/v/o), or
Qwen3-VL-2B / -8B (``--family qwen3_vl --size 2b|8b``; every variant but the batched-window ones, which that
family has no path for).

    PYTHONPATH=src python benchmarks/train_step.py            # on a CUDA GPU (the figures of docs/benchmarks.md)
    PYTHONPATH=src python benchmarks/train_step.py --tiny     # the same code paths on a CPU, in seconds
    PYTHONPATH=src python benchmarks/train_step.py --family qwen3_vl --size 2b --variants a,c28,c14,c0

Inputs: groups of 8 pairs (1 positive + 7 negatives), ~600 text tokens +-25% and one 448x448 image
(256 visual tokens) per pair, from a fixed seed; every variant sees the same groups in the same order.
Variants (one process, one model; ``--variants`` picks):

* ``a``  naive Hugging Face step: full forward with full-vocabulary logits, SDPA, activation
         checkpointing on (every layer), listwise loss on yes-no at the last position;
* ``b``  the same with checkpointing off;
* ``c...`` the project's step: ``LycheeReranker.forward`` (yes/no logits of the last position only)
         + ``listwise_loss`` + the fast vision path + checkpointing of ``K`` decoder layers.
         Spelled ``c<K>`` (``c28``, ``c12``, ``c0``), ``cnv<K>`` = the same without the fast vision path
         (to attribute the gains), ``cw<K>`` = batched windows only (no ``no_grad`` tower).
         ``K`` may be ``auto``: the layers ``training/memory.py`` picks for ``--max-peak-gib`` from the groups'
         longest micro-batch (padded tokens, or real tokens with ``+pack``), as a stage with
         ``activation_checkpointing: auto`` does.
* levers, appended to a project variant with ``+`` (any combination, e.g. ``c17+pack+liger``):
  ``+pack``    pairs packed into one sequence without padding (``model.pack_pairs``, reranker/packing.py);
  ``+liger``   liger-kernel's fused RMSNorm / SwiGLU / rope (``model.kernels: liger``, reranker/kernels.py);
  ``+compile`` ``torch.compile`` of every decoder layer (``model.compile_layers``);
  ``+nodrop``  LoRA dropout off (``lora.dropout: 0``): the H100 profile put its mask and scale kernels at 4.2%;
  ``+fp8``     FP8 matmuls on the frozen base projections (``model.fp8``, torchao; Hopper; one way: list last);
  ``+peftlora`` peft's own LoRA forward instead of the one-function branch (``lora.fused: false``,
              reranker/lora_branch.py; on CUDA, where ``auto`` turns the branch on), to measure what it saves.
  After each variant its eval-mode yes-no scores on unseen groups are compared with the plain padded
  project step's at the same weights: max |diff|, rankings, flipped document pairs.

Each step is the stage's (``training/step.py``) on a CUDA device under bf16 autocast, as ``accelerate`` runs a
stage's model (the model's weights are bf16, its LoRA adapters fp32): forward, loss, backward, gradient clipping, fused AdamW step
(a non-finite step skipped on the device), zero_grad. Warm-up, then the median
of ``--steps`` steps with CUDA synchronisation. Prints pairs/s, tokens/s, peak GiB, MFU (4 x LM params
x tokens + 2 x vision params x patches over the bf16 matmul rate measured in this run) and the ratio
of the project's step to (a). Checks the project step's loss (and LoRA gradients) against the naive
path on the same inputs. Imports only torch, transformers, peft, lychee_pipeline.reranker and
lychee_pipeline.training's step and memory model (no kedro, no mlflow).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from lychee_pipeline.reranker import kernels as fused_kernels  # noqa: E402
from lychee_pipeline.reranker import lora_branch  # noqa: E402
from lychee_pipeline.reranker import packing  # noqa: E402
from lychee_pipeline.reranker.families import require_fast_path  # noqa: E402
from lychee_pipeline.reranker.losses import LossOptions, get_loss, listwise_loss  # noqa: E402
from lychee_pipeline.reranker.model import (  # noqa: E402
    LycheeReranker,
    ModelConfig,
    _apply_lora,
    _freeze_vision,
    enable_activation_checkpointing,
)
from lychee_pipeline.training import memory  # noqa: E402
from lychee_pipeline.training.step import MicroBatch, OneProcess, TrainStep  # noqa: E402

NON_MODEL_KEYS = ("labels", "group_size")


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# model


def build_reranker(tiny: bool, device: torch.device, dtype: torch.dtype) -> LycheeReranker:
    """The 7B architecture, random weights on ``device``, prepared as ``load_reranker`` prepares a
    LoRA fine-tune (the project's own LoRA / freezing functions), wrapped in ``LycheeReranker``."""
    cfg = ModelConfig(name_or_path=f"random:{common.architecture_name(tiny)}", finetune="lora",
                      lora={"r": 16, "alpha": 32, "dropout": 0.05})
    config = common.build_config(tiny=tiny)
    model = common.build_model(config, device, dtype, attn_implementation=cfg.attn_implementation)
    model = _apply_lora(model, cfg, device)
    _freeze_vision(model)
    reranker = LycheeReranker(model, processor=None, config=cfg, yes_id=common.YES_ID, no_id=common.NO_ID)
    reranker.train(True)
    return reranker


def set_checkpointing(reranker: LycheeReranker, layers: int | None) -> int:
    """``None``: the stock switch on every layer (as ``load_reranker`` does); ``K``: selective; ``0``: off."""
    hf_model = reranker.base_model
    if layers is None:
        if getattr(hf_model, "_require_grads_hooks", None):
            hf_model.disable_input_require_grads()  # do not stack hooks when switching back and forth
        enable_activation_checkpointing(hf_model)
        return len(common.family().decoder_layers(hf_model))
    if layers == 0:
        common.family().apply_selective_checkpointing(reranker, 0)
        if hasattr(hf_model, "disable_input_require_grads") and getattr(hf_model, "_require_grads_hooks", None):
            hf_model.disable_input_require_grads()  # a fresh model without checkpointing has no such hooks
        return 0
    return common.family().apply_selective_checkpointing(reranker, layers)


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}


def naive_listwise(z: torch.Tensor, group_size: int) -> torch.Tensor:
    """Listwise (InfoNCE) loss on yes-no, positive first in each group (written out, not the project's)."""
    scores = (z[:, 0] - z[:, 1]).view(-1, group_size)
    return F.cross_entropy(scores, torch.zeros(scores.size(0), dtype=torch.long, device=scores.device))


def naive_logits(reranker: LycheeReranker, batch: dict) -> torch.Tensor:
    out = reranker.backbone(**model_inputs(batch), use_cache=False, return_dict=True)
    return out.logits[:, -1, [reranker.yes_id, reranker.no_id]].float()


def project_logits(reranker: LycheeReranker, batch: dict) -> torch.Tensor:
    return reranker(**model_inputs(batch))


# ----------------------------------------------------------------------------------------------
# variants


LEVERS = ("pack", "liger", "compile", "nodrop", "fp8", "peftlora")


def parse_variant(name: str, num_layers: int, auto_layers: dict | None = None) -> dict:
    """``a``, ``b``, ``c<K>``/``cnv<K>``/``cw<K>`` (``K`` a count or ``auto``), plus ``+pack``/``+liger``/``+compile``.

    ``auto_layers``: {"padded" | "pack" | "pack+liger": CheckpointChoice} once the inputs are known."""
    base, *levers = name.split("+")
    unknown = [x for x in levers if x not in LEVERS]
    if unknown:
        raise ValueError(f"unknown lever(s) {unknown} in variant {name!r} (known: {', '.join(LEVERS)})")
    flags = {lever: lever in levers for lever in LEVERS}
    if base in ("a", "b"):
        if levers:
            raise ValueError(f"levers apply to the project step (c...), not to the naive variant {base!r}")
        label = f"naive HF, checkpointing {'on' if base == 'a' else 'off'}"
        return {"name": name, "forward": "naive", "fast": None, "ckpt": None if base == "a" else 0, "label": label,
                **flags}
    for prefix, fast, what in (("cnv", None, "no fast vision"), ("cw", "windows", "batched windows only"), ("c", "all", "fast vision")):
        count = base[len(prefix):]
        if base.startswith(prefix) and (count.isdigit() or count == "auto"):
            if count == "auto":
                regime = ("pack+liger" if flags["liger"] else "pack") if flags["pack"] else "padded"
                k = num_layers if auto_layers is None else auto_layers[regime].layers
            else:
                k = min(int(count), num_layers)
            extra = "".join(f" +{lever}" for lever in LEVERS if flags[lever])
            auto = " (auto)" if count == "auto" else ""
            return {"name": name, "forward": "project", "fast": fast, "ckpt": k, **flags,
                    "label": f"project step, {what}, {k}/{num_layers} layers checkpointed{auto}{extra}"}
    raise ValueError(f"unknown variant {name!r}")


def set_liger(reranker: LycheeReranker, on: bool) -> None:
    """liger-kernel on the model instance, or back to the plain modules (so variants may come in any order)."""
    targets = common.family().fused_kernel_targets()
    patched = any("forward" in m.__dict__ and m._get_name().startswith("Liger") for m in reranker.modules())
    if on and not patched:
        fused_kernels.resolve_kernels("liger", reranker.device)  # one-line error without liger-kernel or CUDA
        log(f"liger-kernel applied: {fused_kernels.apply_liger(reranker.base_model, targets)}")
    elif not on and patched:
        fused_kernels.remove_liger(reranker.base_model, targets)


def set_compile(reranker: LycheeReranker, on: bool) -> None:
    layers = common.family().decoder_layers(reranker)
    if on and any(layer._compiled_call_impl is None for layer in layers):
        fused_kernels.compile_decoder_layers(reranker)
    elif not on:
        for layer in layers:
            layer._compiled_call_impl = None


def set_fp8(reranker: LycheeReranker, on: bool) -> None:
    """``model.fp8`` on the frozen base projections (the LoRA adapters stay bf16): one way, so ``+fp8`` variants
    come last. Refused in one line where FP8 cannot run; torchao's emulation on a CPU (the code path only)."""
    from lychee_pipeline.reranker import fp8

    done = getattr(reranker, "_bench_fp8", False)
    if on and not done:
        emulate = reranker.device.type != "cuda"
        if not emulate:
            fp8.require_fp8(reranker.device, "lora")
        elif importlib.util.find_spec("torchao") is None:
            raise RuntimeError("+fp8 needs torchao (pip install 'lychee_pipeline[gpu]')")
        count = fp8.apply_fp8(reranker.backbone, common.family().language_models(reranker.backbone), emulate=emulate)
        reranker._bench_fp8 = True
        log(f"fp8: {count} frozen base projections run FP8 matmuls{' (EMULATED on the CPU)' if emulate else ''}")
    elif done and not on:
        raise RuntimeError("+fp8 converts the model in place: list the +fp8 variants last")


def configure(reranker: LycheeReranker, spec: dict) -> None:
    family = common.family()
    for lever, fast_path in (("pack", "pack_pairs"), ("liger", "kernels")):
        if spec.get(lever):
            require_fast_path(family, fast_path)  # one line: the family refuses it
    if spec["fast"] == "windows" and family.NAME != "qwen2_5_vl":  # only Qwen2.5-VL has attention windows
        raise SystemExit(f"variant {spec.get('name')}: the {family.NAME} family has no batched-window vision path")
    family.disable_fast_path(reranker)
    if spec["fast"] == "all":
        family.enable_fast_path(reranker)
    elif spec["fast"] == "windows":  # the batched windows alone
        family.enable_fast_path(reranker, frozen_vision_no_grad=False, matmul_patch_embed=False)
    set_checkpointing(reranker, spec["ckpt"])
    # the packed attention function is plain SDPA for padded batches: once enabled it stays
    if spec.get("pack"):
        packing.enable_packed_attention(reranker)
    reranker.config.pack_pairs = bool(spec.get("pack"))
    set_liger(reranker, bool(spec.get("liger")))
    set_lora_dropout(reranker, not spec.get("nodrop"))
    set_lora_branch(reranker, fused=lora_branch.wants_fused("auto", reranker.device) and not spec.get("peftlora"))
    set_fp8(reranker, bool(spec.get("fp8")))
    set_compile(reranker, bool(spec.get("compile")))


def set_lora_branch(reranker: LycheeReranker, fused: bool) -> None:
    """The one-function LoRA branch (``lora.fused: auto``: on CUDA, as a stage runs) or peft's own forward."""
    if fused:
        lora_branch.fuse_lora_branches(reranker.backbone)
    else:
        lora_branch.unfuse_lora_branches(reranker.backbone)


_LORA_DROPOUT_P: dict[int, float] = {}


def set_lora_dropout(reranker: LycheeReranker, on: bool) -> None:
    """LoRA's dropout at its configured rate, or off (p = 0: peft's dropout modules then return their input, so
    neither the mask nor the scale kernels run; the configured rates are kept to switch back)."""
    for name, module in reranker.named_modules():
        if isinstance(module, torch.nn.Dropout) and ".lora_dropout." in name:
            _LORA_DROPOUT_P.setdefault(id(module), module.p)
            module.p = _LORA_DROPOUT_P[id(module)] if on else 0.0


def auto_checkpointing(reranker: LycheeReranker, groups_cpu: list, budget_gib: float) -> dict:
    """What ``activation_checkpointing: auto`` picks for these groups, padded and packed (training/memory.py)."""
    text = reranker.base_model.config.text_config
    weights = memory.weights_bytes(reranker)
    layers = len(common.family().decoder_layers(reranker))
    padded = max(int(g["attention_mask"].numel()) for g in groups_cpu)
    packed = max(int(g["attention_mask"].sum()) for g in groups_cpu)
    # the packed-and-fused constants hold for +pack+liger; +pack alone keeps the (larger) padded ones
    return {kind: memory.choose_checkpoint_layers(tokens, int(text.hidden_size), layers, weights, budget_gib,
                                                  costs=memory.activation_costs(
                                                      packed=kind != "padded", fused=kind == "pack+liger",
                                                      lora_branch=lora_branch.wants_fused("auto", reranker.device)))
            for kind, tokens in (("padded", padded), ("pack", packed), ("pack+liger", packed))}


@torch.no_grad()
def eval_scores(reranker: LycheeReranker, groups: list) -> list[torch.Tensor]:
    """Eval-mode yes-no scores of the project forward in its current configuration, per group."""
    was_training = reranker.training
    reranker.eval()
    out = []
    for batch in groups:
        z = project_logits(reranker, batch)
        out.append((z[:, 0] - z[:, 1]).float().cpu())
    reranker.train(was_training)
    return out


def compare_scores(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    """max |diff|, groups ranked identically, discordant document pairs and the largest reference gap among them."""
    diff, same, discordant, worst_gap, total = 0.0, 0, 0, 0.0, 0
    for r, g in zip(ref, got):
        diff = max(diff, float((r - g).abs().max()))
        same += bool(torch.equal(r.argsort(descending=True), g.argsort(descending=True)))
        dr = r[:, None] - r[None, :]
        dg = g[:, None] - g[None, :]
        upper = torch.triu(torch.ones_like(dr, dtype=torch.bool), diagonal=1)
        flips = upper & (torch.sign(dr) != torch.sign(dg))
        total += int(upper.sum())
        discordant += int(flips.sum())
        if flips.any():
            worst_gap = max(worst_gap, float(dr[flips].abs().max()))
    return {"max_abs_score_diff": diff, "same_ranking": same, "groups": len(ref), "discordant_pairs": discordant,
            "doc_pairs": total, "largest_ref_gap_flipped": worst_gap}


def make_step(reranker: LycheeReranker, spec: dict, groups: list, optimizer, trainable):
    """``step(i)`` on group ``i``: the stage's step (training/step.py) on one process; the naive variants swap in
    their full-logits forward and written-out loss, the rest of the step (clipping, fused AdamW with the
    non-finite skip on the device, zero_grad) is the stage's."""
    autocast = torch.autocast(reranker.device.type, dtype=torch.bfloat16, enabled=reranker.device.type == "cuda")
    if spec["forward"] == "naive":
        def model_forward(**inputs):
            return naive_logits(reranker, inputs)

        def compute_loss(logits, labels, group_weight, options):
            return naive_listwise(logits, options.group_size)
    else:
        model_forward, compute_loss = reranker, get_loss("listwise")

    def forward(**inputs):  # bf16 autocast on CUDA, as the stage's prepared model runs
        with autocast:
            return model_forward(**inputs)

    batches = [MicroBatch.unweighted(batch) for batch in groups]
    train_step = TrainStep(OneProcess(reranker.device), forward, optimizer, None, trainable, compute_loss,
                           LossOptions(groups[0]["group_size"], temperature=1.0), max_grad_norm=1.0,
                           skip_on_device=True)

    def step(i: int):
        return train_step(batches[i % len(batches)])

    return step


# ----------------------------------------------------------------------------------------------
# checks


@torch.no_grad()
def check_losses(reranker: LycheeReranker, groups: list, spec: dict) -> dict:
    """Eval-mode losses and yes-no scores: naive full-logits path vs the project step's path."""
    was_training = reranker.training
    reranker.eval()
    out = {"loss_naive": [], "loss_project": [], "max_abs_score_diff": 0.0, "same_order": True}
    for batch in groups:
        configure(reranker, {"fast": None, "ckpt": 0})
        zn = naive_logits(reranker, batch)
        configure(reranker, spec)
        zp = project_logits(reranker, batch)
        g = batch["group_size"]
        out["loss_naive"].append(float(naive_listwise(zn, g)))
        out["loss_project"].append(float(listwise_loss(zp, g, temperature=1.0)))
        sn, sp = zn[:, 0] - zn[:, 1], zp[:, 0] - zp[:, 1]
        out["max_abs_score_diff"] = max(out["max_abs_score_diff"], float((sn - sp).abs().max()))
        out["same_order"] &= bool(torch.equal(sn.argsort(descending=True), sp.argsort(descending=True)))
    reranker.train(was_training)
    out["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(out["loss_naive"], out["loss_project"]))
    return out


def lora_dropout_modules(reranker: LycheeReranker):
    return [m for name, m in reranker.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name]


def check_grads(reranker: LycheeReranker, batch: dict, spec: dict, trainable) -> dict:
    """LoRA gradients of one step, naive (checkpointing on) vs the project's step; LoRA dropout off."""
    drops = lora_dropout_modules(reranker)
    saved = [d.p for d in drops]
    for d in drops:
        d.p = 0.0
    grads = {}
    try:
        for kind, variant in (("naive", {"fast": None, "ckpt": None}), ("project", spec)):
            configure(reranker, variant)
            for p in trainable:
                p.grad = None
            if kind == "naive":
                loss = naive_listwise(naive_logits(reranker, batch), batch["group_size"])
            else:
                loss = listwise_loss(project_logits(reranker, batch), batch["group_size"], temperature=1.0)
            loss.backward()
            grads[kind] = (loss.item(), torch.cat([p.grad.float().reshape(-1) for p in trainable]))
            for p in trainable:
                p.grad = None
    finally:
        for d, p in zip(drops, saved):
            d.p = p
    gn, gp = grads["naive"][1], grads["project"][1]
    return {
        "loss_naive": grads["naive"][0],
        "loss_project": grads["project"][0],
        "grad_rel_diff": float((gn - gp).norm() / gn.norm().clamp_min(1e-30)),
        "grad_cosine": float(F.cosine_similarity(gn, gp, dim=0)),
    }


@torch.no_grad()
def vision_micro(reranker: LycheeReranker, batch: dict, device: torch.device, reps: int) -> dict:
    """The vision tower alone on one group's images: stock path vs batched windows (no grad)."""
    visual = reranker.base_model.model.visual
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    res = {}
    outs = {}
    for name, fast in (("stock", None), ("batched", "windows")):
        configure(reranker, {"fast": fast, "ckpt": 0})
        times = common.time_steps(lambda i: visual(pixels, grid_thw=grid), device, warmup=1, steps=reps)
        outs[name] = visual(pixels, grid_thw=grid).pooler_output.float()
        res[f"{name}_ms"] = statistics.median(times) * 1e3
    a, b = outs["stock"], outs["batched"]
    res["rel_diff"] = float((a - b).norm() / a.norm())
    res["max_abs_diff"] = float((a - b).abs().max())
    return res


MATMUL_KERNEL_KEYS = ("gemm", "matmul", "sm90", "cutlass", "nvjet", "xmma", "cublas",  # CUDA kernels
                      "aten::mm", "aten::addmm", "aten::bmm")  # the CPU's ops


def non_matmul_table(kernels: list, dev_attr: str, total_dev_ms: float, rows: int = 15) -> str:
    """The ``rows`` device kernels taking the most time that are not matmuls (where the step's other time goes):
    name, calls, total ms, share of all device time."""
    others = sorted((e for e in kernels if not any(k in e.key.lower() for k in MATMUL_KERNEL_KEYS)),
                    key=lambda e: -getattr(e, dev_attr, 0.0))[:rows]
    lines = [f"top {rows} non-matmul device kernels:", f"{'ms':>9} {'share':>6} {'calls':>7}  kernel"]
    for e in others:
        ms = getattr(e, dev_attr, 0.0) / 1e3
        lines.append(f"{ms:9.2f} {100 * ms / max(total_dev_ms, 1e-9):5.1f}% {e.count:7d}  {e.key[:110]}")
    return "\n".join(lines)


def profile_variant(reranker, spec, groups, optimizer, trainable, device, out_dir: Path | None, steps: int = 2,
                    trace: Path | None = None) -> str:
    """torch.profiler over ``steps`` steps; returns a short text summary (totals, the top kernels, the top 15
    non-matmul device kernels); ``trace``: a Chrome trace (JSON, chrome://tracing or Perfetto) written there."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    configure(reranker, spec)
    step = make_step(reranker, spec, groups, optimizer, trainable)
    step(0)
    common.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        for i in range(steps):
            step(i + 1)
        common.sync(device)
    wall = time.perf_counter() - t0
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    dev_attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [e for e in events if e.device_type == DeviceType.CUDA] if device.type == "cuda" else list(events)
    total_dev = sum(getattr(e, dev_attr, 0.0) for e in kernels) / 1e3  # kernels only (ops would count twice)
    total_cpu = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3
    n_kernels = sum(e.count for e in kernels) if device.type == "cuda" else 0
    sdpa = [e for e in events if e.key == "aten::scaled_dot_product_attention"]
    mm_dev = sum(getattr(e, dev_attr, 0.0) for e in kernels if any(k in e.key.lower() for k in MATMUL_KERNEL_KEYS)) / 1e3
    table = events.table(sort_by=dev_attr, row_limit=18, max_name_column_width=60)
    summary = (
        f"profile {spec['name']} ({spec['label']}): {steps} steps, wall {wall * 1e3:.0f} ms, "
        f"self CPU {total_cpu:.0f} ms, self device {total_dev:.0f} ms (matmul kernels {mm_dev:.0f} ms, "
        f"{100 * mm_dev / max(total_dev, 1e-9):.0f}%), SDPA calls {sum(e.count for e in sdpa)}, kernels {n_kernels}"
        + (f"; Chrome trace {trace}" if trace is not None else "")
    )
    text = summary + "\n" + table + "\n" + non_matmul_table(kernels, dev_attr, total_dev)
    if out_dir is not None:
        # '+' in a variant's name is kept out of the file name (some copy tools refuse it)
        (out_dir / f"profile_{spec['name'].replace('+', '_')}.txt").write_text(text + "\n")
    return text


# ----------------------------------------------------------------------------------------------


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny architecture, CPU-sized inputs")
    parser.add_argument("--variants", default="a,b,c28,c16,c12",
                        help="comma-separated: a, b, c<K>, cnv<K>, cw<K> (K a count or auto), levers +pack +liger +compile")
    parser.add_argument("--project", default=None,
                        help="the variant reported as (c) (default: the fastest c<K> within --max-peak-gib)")
    parser.add_argument("--groups", type=int, default=12, help="distinct input groups (cycled)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", default="",
                        help="comma-separated variants to profile (2 steps each, after their timing), and/or a path "
                             "ending in .json: the Chrome trace of the profiled variant (the project variant (c) "
                             "when no variant is named); prints the top 15 non-matmul device kernels")
    parser.add_argument("--vision-micro", type=int, default=5, help="repetitions of the vision-tower timing (0: skip)")
    parser.add_argument("--check-groups", type=int, default=2, help="groups for the loss check (0: skip)")
    parser.add_argument("--no-grad-check", action="store_true")
    parser.add_argument("--no-score-check", action="store_true",
                        help="skip comparing each project variant's eval scores with the plain padded step's")
    parser.add_argument("--max-peak-gib", type=float, default=40.0)
    parser.add_argument("--sdpa-backends", default="project",
                        help="project (what load_reranker sets: no cuDNN attention, which plans each new shape), or "
                             "a comma-separated subset of flash,efficient,cudnn,math that SDPA may use (all four: "
                             "PyTorch's default)")
    common.add_run_args(parser, seed=1234)
    return parser


def set_sdpa_backends(choice: str, device: torch.device) -> None:
    """``project``: what load_reranker sets; else the comma-separated backends SDPA may use."""
    if choice == "project":
        fused_kernels.avoid_cudnn_attention(device)
    else:
        allowed = set(choice.split(","))
        torch.backends.cuda.enable_flash_sdp("flash" in allowed)
        torch.backends.cuda.enable_mem_efficient_sdp("efficient" in allowed)
        torch.backends.cuda.enable_cudnn_sdp("cudnn" in allowed)
        torch.backends.cuda.enable_math_sdp("math" in allowed)
        log(f"SDPA backends allowed: {sorted(allowed)}")


def time_variants(args, reranker, specs: list[dict], groups: list, check_groups: list, optimizer, trainable,
                  device: torch.device, results: dict, *, plain: dict, pairs_per_group: int, tokens_per_group: float,
                  flops_per_group: float, tflops: float, profiles: set[str], peak: float = float("nan")) -> None:
    """Each variant configured, timed (median step), and its eval scores compared with those of ``plain`` (the
    padded project step, no lever); ``results[name]`` gets its figures."""
    for spec in specs:
        try:
            configure(reranker, spec)
        except RuntimeError as exc:  # e.g. +liger without liger-kernel or CUDA: say so, run the other variants
            log(f"{spec['name']}: skipped: {exc}")
            continue
        common.reset_peak(device)
        step = make_step(reranker, spec, groups, optimizer, trainable)
        try:
            times = common.time_steps(step, device, args.warmup, args.steps)
        except torch.OutOfMemoryError as exc:  # pragma: no cover - GPU only
            log(f"{spec['name']}: out of memory ({exc})")
            optimizer.zero_grad(set_to_none=True)
            common.reset_peak(device)
            continue
        med = statistics.median(times)
        pairs = pairs_per_group / med
        tokens = tokens_per_group / med
        useful = flops_per_group / med
        r = {
            "label": spec["label"], "median_s": med, "min_s": min(times), "max_s": max(times),
            "pairs_per_s": pairs, "tokens_per_s": tokens, "peak_gib": common.peak_gib(device),
            "mfu": common.mfu(useful, tflops), "mfu_datasheet": common.mfu(useful, peak), "steps": len(times),
        }
        results[spec["name"]] = r
        log(f"{spec['name']:>6}: {pairs:6.2f} pairs/s {tokens:8.0f} tok/s peak {r['peak_gib']:6.1f} GiB "
            f"MFU {100 * r['mfu']:5.1f}% of measured, {100 * r['mfu_datasheet']:5.1f}% of datasheet  "
            f"step {med * 1e3:.0f} ms [{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}]  {spec['label']}")
        optimizer.zero_grad(set_to_none=True)
        if spec.get("fp8") and not args.no_score_check:  # converted in place: no plain step left to compare with
            log(f"{spec['name']:>6}: no score check (FP8 converts the model in place; inference.py --fp8 measures "
                f"FP8's differences against fp32)")
        elif not args.no_score_check and spec["forward"] == "project":
            got = eval_scores(reranker, check_groups)  # the same weights for both: the steps above trained them
            configure(reranker, plain)
            cmp = compare_scores(eval_scores(reranker, check_groups), got)
            configure(reranker, spec)
            r["score_check"] = cmp
            log(f"{spec['name']:>6}: scores vs the plain padded step ({len(check_groups)} unseen groups, eval): max |diff| "
                f"{cmp['max_abs_score_diff']:.2e}, same ranking {cmp['same_ranking']}/{cmp['groups']} groups, "
                f"{cmp['discordant_pairs']}/{cmp['doc_pairs']} document pairs flipped "
                f"(largest reference gap among them {cmp['largest_ref_gap_flipped']:.2e})")
        if spec["name"] in profiles:  # right after its timing, in the same configuration
            log(profile_variant(reranker, spec, groups, optimizer, trainable, device, args.out,
                                trace=getattr(args, "trace", None)))


def print_summary(results: dict, env: dict, tflops: float, project_name: str | None, max_peak_gib: float,
                  device: torch.device, peak: tuple[float, str] = (float("nan"), "none")) -> None:
    """The table of the variants, and (c) against (a); ``results["ratio_c_over_a"]`` when both ran. MFU twice:
    against the bf16 matmul rate measured in this run, and against the datasheet peak (``peak``: rate, which)."""
    log("")
    log(f"summary ({env.get('gpu')}, torch {env['torch']}, transformers {env['transformers']}); MFU against the "
        f"measured bf16 matmul rate {tflops:.0f} TFLOP/s, and against the datasheet peak {peak[0]:.0f} TFLOP/s "
        f"({peak[1]})")
    base = results.get(project_name, {}).get("pairs_per_s") if project_name else None
    log(f"{'variant':>18} {'pairs/s':>8} {'tok/s':>8} {'peak GiB':>9} {'MFU meas':>8} {'MFU spec':>8} {'vs (c)':>7}  what")
    for name, r in results.items():
        if isinstance(r, dict) and "pairs_per_s" in r:
            vs = f"{r['pairs_per_s'] / base:6.2f}x" if base else f"{'':>7}"
            log(f"{name:>18} {r['pairs_per_s']:8.2f} {r['tokens_per_s']:8.0f} {r['peak_gib']:9.1f} {100 * r['mfu']:7.1f}% "
                f"{100 * r.get('mfu_datasheet', float('nan')):7.1f}% {vs}  {r['label']}")
    if project_name in results and "a" in results:
        ratio = results[project_name]["pairs_per_s"] / results["a"]["pairs_per_s"]
        results["ratio_c_over_a"] = ratio
        ok_mem = results[project_name]["peak_gib"] <= max_peak_gib or device.type != "cuda"
        log(f"(c) = {project_name}: {ratio:.2f}x (a) in pairs/s; peak {results[project_name]['peak_gib']:.1f} GiB "
            f"({'within' if ok_mem else 'OVER'} {max_peak_gib:.0f} GiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    device, dtype = common.pick_device(parser, args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    set_sdpa_backends(args.sdpa_backends, device)
    env = common.environment(device)
    log(f"env {json.dumps(env)}")
    tflops = common.matmul_tflops(device)
    peak = common.datasheet_tflops(device)
    log(f"matmul rate: {tflops:.0f} TFLOP/s measured ({'bf16 8192^3' if device.type == 'cuda' else 'fp32 512^3, CPU'}); "
        f"datasheet peak {peak[0]:.0f} TFLOP/s ({peak[1]})")

    t0 = time.perf_counter()
    reranker = build_reranker(args.tiny, device, dtype)
    n_lm, n_vis, n_total = common.count_params(reranker)
    trainable = [p for p in reranker.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    num_layers = len(common.family().decoder_layers(reranker))
    log(f"model built in {time.perf_counter() - t0:.1f} s: LM {n_lm / 1e9:.3f}B, vision {n_vis / 1e9:.3f}B, "
        f"total {n_total / 1e9:.3f}B, LoRA trainable {n_train / 1e6:.2f}M, {num_layers} decoder layers")
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)  # as the DDP stage's

    shape = common.Shape.tiny() if args.tiny else common.Shape()
    groups_cpu = [common.synthetic_group(shape, seed=args.seed + i) for i in range(args.groups)]
    groups = [common.to_device(g, device) for g in groups_cpu]
    stats = [common.batch_stats(g) for g in groups_cpu]
    tok_per_group = statistics.mean(s["tokens"] for s in stats)
    pad_frac = 1 - sum(s["tokens"] for s in stats) / sum(s["padded_tokens"] for s in stats)
    log(f"inputs: {args.groups} groups x {shape.group_size} pairs, {tok_per_group / shape.group_size:.0f} tokens/pair "
        f"(real), padding {100 * pad_frac:.1f}% of the padded batch, {stats[0]['patches'] // shape.group_size} patches/image")

    auto_layers = auto_checkpointing(reranker, groups_cpu, args.max_peak_gib)
    for kind, choice in auto_layers.items():
        log(f"auto checkpointing, {kind}: {choice.describe()}")
    specs = [parse_variant(v.strip(), num_layers, auto_layers) for v in args.variants.split(",") if v.strip()]
    c_specs = [s for s in specs if s["forward"] == "project"]
    project_name = args.project or (c_specs[-1]["name"] if c_specs else None)

    profiles = {p.strip() for p in args.profile.split(",") if p.strip()}
    traces = {p for p in profiles if p.endswith(".json")}
    profiles -= traces
    args.trace = Path(traces.pop()) if traces else None
    if args.trace is not None and not profiles and c_specs:
        # the first project variant: later ones may be skipped where their library is missing (+fp8 without torchao)
        profiles = {args.project or c_specs[0]["name"]}
    # the loss / gradient checks use groups no step has trained on
    check_groups = [common.to_device(common.synthetic_group(shape, seed=args.seed + 10_000 + i), device)
                    for i in range(max(args.check_groups, 1))]
    results = {}
    if args.vision_micro > 0:
        vm = vision_micro(reranker, groups[0], device, args.vision_micro)
        results["vision_micro"] = vm
        log(f"vision tower, {shape.group_size} images: stock {vm['stock_ms']:.1f} ms, batched windows {vm['batched_ms']:.1f} ms "
            f"(x{vm['stock_ms'] / vm['batched_ms']:.2f}); rel diff {vm['rel_diff']:.2e}, max abs {vm['max_abs_diff']:.2e}")

    time_variants(args, reranker, specs, groups, check_groups, optimizer, trainable, device, results,
                  plain=parse_variant("c0", num_layers), pairs_per_group=shape.group_size,
                  tokens_per_group=tok_per_group,
                  flops_per_group=4 * n_lm * tok_per_group + 2 * n_vis * stats[0]["patches"], tflops=tflops,
                  profiles=profiles, peak=peak[0])

    if args.project is None:  # the fastest project step (fast vision) within the memory limit
        fits = [(r["pairs_per_s"], n) for n, r in results.items() if isinstance(r, dict) and "pairs_per_s" in r
                and n.startswith("c") and n[1:].isdigit() and (r["peak_gib"] <= args.max_peak_gib or device.type != "cuda")]
        if fits:
            project_name = max(fits)[1]
    if project_name is not None:
        spec = parse_variant(project_name, num_layers, auto_layers)
        if args.check_groups > 0:
            chk = check_losses(reranker, check_groups[: args.check_groups], spec)
            results["check_losses"] = chk
            log(f"loss check ({project_name} vs naive, eval mode, unseen groups): naive {['%.5f' % x for x in chk['loss_naive']]} "
                f"project {['%.5f' % x for x in chk['loss_project']]} max |diff| {chk['max_abs_loss_diff']:.2e}, "
                f"max |score diff| {chk['max_abs_score_diff']:.2e}, same ranking {chk['same_order']}")
        if not args.no_grad_check:
            common.reset_peak(device)
            gc = check_grads(reranker, check_groups[0], spec, trainable)
            results["check_grads"] = gc
            log(f"grad check ({project_name} vs naive with checkpointing, LoRA dropout off, unseen group): loss {gc['loss_naive']:.5f} vs "
                f"{gc['loss_project']:.5f}, LoRA grad rel diff {gc['grad_rel_diff']:.2e}, cosine {gc['grad_cosine']:.6f}")

    # per-layer activation memory, from the c<K> runs (peak = fixed + slope * kept layers)
    ks = sorted((parse_variant(n, num_layers)["ckpt"], r["peak_gib"]) for n, r in results.items()
                if n.startswith("c") and n[1:].isdigit() and isinstance(r, dict) and "peak_gib" in r)
    if len(ks) >= 2 and device.type == "cuda":
        (k1, p1), (k2, p2) = ks[0], ks[-1]
        slope = (p1 - p2) / (k2 - k1)  # GiB per layer that keeps its activations
        per_tok = slope * 2**30 / (shape.group_size * max(int(g["attention_mask"].shape[1]) for g in groups_cpu))
        results["memory_model"] = {"gib_per_kept_layer": slope, "bytes_per_padded_token_per_kept_layer": per_tok,
                                   "peak_all_checkpointed_gib": p2 if k2 == num_layers else None}
        log(f"memory: {slope:.2f} GiB per decoder layer that keeps its activations "
            f"(~{per_tok / 1024:.0f} KiB per padded token per layer)")

    print_summary(results, env, tflops, project_name, args.max_peak_gib, device, peak)
    if args.out is not None:
        (args.out / ("train_step_tiny.json" if args.tiny else "train_step.json")).write_text(
            json.dumps({"env": env, "matmul_tflops": tflops, "datasheet_tflops": peak[0], "results": results}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
