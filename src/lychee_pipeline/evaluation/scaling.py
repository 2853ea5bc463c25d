"""The scaling report: how throughput, cost and quality change with the number of devices.

Input: one ``StageResult`` (training/stage.py) per training stage, or a mapping with its field names (a
stage list read back from JSON, older results), with at least ``stage`` (or ``name``), ``devices``,
``device_type`` (``"cuda"`` or ``"cpu"``), ``wall_time_s``, ``train_pairs``, and optionally
``pairs_per_s`` (else ``train_pairs / wall_time_s``), ``peak_mem_gib`` (one number per device, or a
single number) and ``mrr_at_10``.

Per stage:

* ``pairs_per_s``: training pairs processed per second, all devices together.
* ``scaling_efficiency = pairs_per_s(N) / (N * pairs_per_s(1))`` against the 1-device stage of the
  same device type. Without a 1-device stage the smallest device count ``M`` of that type is the
  reference: ``pairs_per_s(N) * M / (N * pairs_per_s(M))`` (the ``reference_devices`` field says so).
* ``epoch_time_s = full_train_pairs / pairs_per_s``: the projected time of one epoch over the full
  training set.
* ``device_hours_per_epoch = N * epoch_time_s / 3600`` (GPU-hours for CUDA stages), and
  ``relative_device_hours`` the same divided by the reference's (1 / efficiency).
* ``peak_mem_gib_max`` and the per-device list.

Comparability: a stage's ``pairs_per_s`` is timed over its steps after the first (``rate_steps``, from
``steps``). A rate that rests on few steps (a 10-step check stage) is dominated by warm-up and noise, so an
efficiency between it and a long final stage is not a scaling figure. When a row or its reference rests on
fewer than ``MIN_RATE_STEPS`` timed steps, or the two differ by more than ``MAX_RATE_STEPS_RATIO`` times,
``scaling_efficiency`` and ``relative_device_hours`` are ``None``, ``comparable`` is false and
``not_comparable`` says why (the raw ratio stays in ``raw_efficiency``). Stages without ``steps`` are taken as
comparable (older results).

Same window (like with like): when every stage of a device type carries ``step_seconds`` ([step, seconds] of
each optimizer step, written by train.py), all of them are timed over the same steps: after
``WINDOW_WARMUP_STEPS`` warm-up steps, steps ``WINDOW_WARMUP_STEPS + 1`` to the last step every stage timed
(``window`` = [first, last], ``rate_steps`` = its length). ``pairs_per_s`` is then that window's rate
(pairs per step x steps / their seconds); the all-steps rate stays in ``pairs_per_s_all_steps``. A window
shorter than ``MIN_WINDOW_STEPS`` or a stage that did not time every step of it (a resumed stage) is marked
not comparable, with the reason.

The most cost-effective device count is the one with the fewest device-hours per epoch (ties go to
the faster, then to fewer devices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


MIN_RATE_STEPS = 20  # timed steps a rate must rest on before it is compared with another
MAX_RATE_STEPS_RATIO = 4.0
WINDOW_WARMUP_STEPS = 2  # steps left out of every stage's window (first-step compile, allocator warm-up)
MIN_WINDOW_STEPS = 5  # a common window shorter than this is not a scaling figure


def rate_steps(stage: Mapping[str, Any]) -> int | None:
    """The number of steps a stage's pairs/s rests on: all but the first (warm-up) step."""
    steps = stage.get("steps")
    if steps is None:
        return None
    steps = int(steps)
    return steps - 1 if steps > 1 else steps


def _why_not_comparable(row: Mapping[str, Any], ref: Mapping[str, Any]) -> str | None:
    if row.get("window_problem") or ref.get("window_problem"):
        return row.get("window_problem") or ref.get("window_problem")
    if row.get("window") is not None and ref.get("window") is not None:
        return None  # the same steps timed in both: like with like
    a, b = row.get("rate_steps"), ref.get("rate_steps")
    if row is ref or a is None or b is None:
        return None
    if min(a, b) < MIN_RATE_STEPS:
        return (f"rates rest on {a} and {b} timed steps ({row['stage']} vs {ref['stage']}); "
                f"at least {MIN_RATE_STEPS} each are needed")
    if max(a, b) / min(a, b) > MAX_RATE_STEPS_RATIO:
        return (f"rates rest on {a} and {b} timed steps ({row['stage']} vs {ref['stage']}), "
                f"more than {MAX_RATE_STEPS_RATIO:g}x apart")
    return None


def device_label(devices: int, device_type: str) -> str:
    """``"4 GPUs"``, ``"1 GPU"``, ``"2 CPU processes"``."""
    if device_type == "cpu":
        return f"{devices} CPU process" + ("" if devices == 1 else "es")
    return f"{devices} GPU" + ("" if devices == 1 else "s")


def _stage_name(stage: Mapping[str, Any], index: int) -> str:
    return str(stage.get("stage") or stage.get("name") or f"stage_{index}")


def _row(stage: Mapping[str, Any], index: int, full_train_pairs: int | None) -> dict[str, Any]:
    devices = int(stage["devices"])
    if devices < 1:
        raise ValueError(f"stage {_stage_name(stage, index)!r}: devices must be at least 1")
    device_type = str(stage.get("device_type", "cuda"))
    wall = float(stage["wall_time_s"])
    pairs = int(stage["train_pairs"])
    pps = stage.get("pairs_per_s")
    pps = float(pps) if pps is not None else (pairs / wall if wall > 0 else float("nan"))
    mem = stage.get("peak_mem_gib")
    mem_list = [float(m) for m in mem] if isinstance(mem, Sequence) and not isinstance(mem, str) else (
        [float(mem)] if mem is not None else [])
    epoch = full_train_pairs / pps if full_train_pairs and pps > 0 else None
    mrr = stage.get("mrr_at_10")
    return {
        "stage": _stage_name(stage, index),
        "devices": devices,
        "device_type": device_type,
        "label": device_label(devices, device_type),
        "wall_time_s": wall,
        "train_pairs": pairs,
        "pairs_per_s": pps,
        "peak_mem_gib": mem_list,
        "peak_mem_gib_max": max(mem_list) if mem_list else None,
        "epoch_time_s": epoch,
        "device_hours_per_epoch": devices * epoch / 3600.0 if epoch is not None else None,
        "mrr_at_10": float(mrr) if mrr is not None else None,
        "steps": int(stage["steps"]) if stage.get("steps") is not None else None,
        "rate_steps": rate_steps(stage),
        "step_seconds": {int(k): float(v) for k, v in stage.get("step_seconds") or []},
        "pairs_per_step": pairs / int(stage["steps"]) if stage.get("steps") else None,
        "window": None,
    }


def _apply_common_window(group: list[dict[str, Any]], full_train_pairs: int | None) -> None:
    """Time every stage of the group over the same steps (see the module text); rows are updated in place."""
    if not group or not all(r["step_seconds"] and r["pairs_per_step"] for r in group):
        return
    first = WINDOW_WARMUP_STEPS + 1
    last = min(max(r["step_seconds"]) for r in group)
    for r in group:
        r["window"], r["rate_steps"] = [first, last], max(0, last - first + 1)
        r["pairs_per_s_all_steps"] = r["pairs_per_s"]
        missing = [k for k in range(first, last + 1) if k not in r["step_seconds"]]
        if last - first + 1 < MIN_WINDOW_STEPS:
            r["window_problem"] = (f"the common window (steps {first}-{last} after {WINDOW_WARMUP_STEPS} warm-up) has "
                                   f"{max(0, last - first + 1)} steps; at least {MIN_WINDOW_STEPS} are needed")
        elif missing:
            r["window_problem"] = (f"{r['stage']} did not time steps {missing[0]}-{missing[-1]} of the common window "
                                   f"{first}-{last} (resumed?)")
        if r["rate_steps"] and not missing:
            seconds = sum(r["step_seconds"][k] for k in range(first, last + 1))
            r["pairs_per_s"] = r["pairs_per_step"] * r["rate_steps"] / seconds if seconds > 0 else float("nan")
            epoch = full_train_pairs / r["pairs_per_s"] if full_train_pairs and r["pairs_per_s"] > 0 else None
            r["epoch_time_s"] = epoch
            r["device_hours_per_epoch"] = r["devices"] * epoch / 3600.0 if epoch is not None else None


def scaling_report(stages: Sequence[Any], full_train_pairs: int | None) -> dict[str, Any]:
    """Rows per stage (see the module text), the cost-effectiveness verdict and a one-line summary."""
    stages = [s.model_dump() if hasattr(s, "model_dump") else s for s in stages]  # StageResult -> its fields
    rows = [_row(s, i, full_train_pairs) for i, s in enumerate(stages)]
    for device_type in {r["device_type"] for r in rows}:
        group = [r for r in rows if r["device_type"] == device_type]
        _apply_common_window(group, full_train_pairs)
        ref = min(group, key=lambda r: (r["devices"], -r["pairs_per_s"]))
        per_device = ref["pairs_per_s"] / ref["devices"]
        for r in group:
            r["reference_devices"] = ref["devices"]
            r["raw_efficiency"] = r["pairs_per_s"] / (r["devices"] * per_device) if per_device > 0 else None
            if r["device_hours_per_epoch"] is not None and ref["device_hours_per_epoch"]:
                r["relative_device_hours"] = r["device_hours_per_epoch"] / ref["device_hours_per_epoch"]
            else:
                r["relative_device_hours"] = None
            why = _why_not_comparable(r, ref)
            r["comparable"], r["not_comparable"] = why is None, why
            r["scaling_efficiency"] = r["raw_efficiency"] if why is None else None
            if why is not None:
                r["relative_device_hours"] = None
    for r in rows:  # the per-step list served the window; the report keeps its summary only
        r.pop("step_seconds", None)
        r.setdefault("window_problem", None)
    costed = [r for r in rows if r["device_hours_per_epoch"] is not None]
    best = min(costed, key=lambda r: (r["device_hours_per_epoch"], r["epoch_time_s"], r["devices"])) if costed else None
    fastest = min(costed, key=lambda r: (r["epoch_time_s"], r["devices"])) if costed else None
    if best is None:
        summary = ("No stage ran, so there is no scaling verdict." if not rows else
                   "The full training-set size is unknown, so no epoch time or cost could be projected.")
    else:
        unit = "GPU-hours" if best["device_type"] == "cuda" else "CPU-process-hours"
        efficiency = (f"{100 * best['scaling_efficiency']:.0f}% scaling efficiency"
                      if best["scaling_efficiency"] is not None else
                      f"scaling efficiency not comparable: {best['not_comparable']}")
        summary = (
            f"Most cost-effective: {best['label']} ({best['stage']}), "
            f"{best['device_hours_per_epoch']:.3g} {unit} per epoch at {efficiency}"
        )
        if fastest is not None and fastest is not best:
            fast_unit = "GPU-hours" if fastest["device_type"] == "cuda" else "CPU-process-hours"
            summary += (
                f"; fastest: {fastest['label']} ({fastest['stage']}), "
                f"{fastest['epoch_time_s'] / 3600:.3g} h per epoch for "
                f"{fastest['device_hours_per_epoch']:.3g} {fast_unit}"
            )
        summary += "."
    return {
        "full_train_pairs": full_train_pairs,
        "rows": rows,
        "most_cost_effective": (
            {"stage": best["stage"], "devices": best["devices"], "device_type": best["device_type"],
             "label": best["label"]} if best else None
        ),
        "fastest": (
            {"stage": fastest["stage"], "devices": fastest["devices"], "device_type": fastest["device_type"],
             "label": fastest["label"]} if fastest else None
        ),
        "summary": summary,
    }
