"""The training entry point every process of a stage runs: `python -m lychee_pipeline.training.train --spec F`.

One readable loop, top to bottom: read the spec, prepare model / optimizer / scheduler / dataloader with
Accelerate, loop with gradient accumulation, log and checkpoint on the main process, write result.json.
Needs torch, transformers, peft, accelerate and datasets; MLflow only if it is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from lychee_pipeline.reranker import GroupCollator, ModelConfig, listwise_loss, load_reranker, pointwise_loss
from lychee_pipeline.reranker.collate import max_pixels_at
from lychee_pipeline.reranker.processing import ProcessingConfig
from lychee_pipeline.tracking import StageTracker
from lychee_pipeline.training import checkpoints
from lychee_pipeline.training.heartbeat import Heartbeat  # read by the launcher's watchdog (launch.py)
from lychee_pipeline.training.sampling import EpochPermutation, Slot, SlotDataset, loss_scale
from lychee_pipeline.training.schedule import Schedule

log = logging.getLogger("lychee_pipeline.training.train")

ADAPTER_MANIFEST = "adapter.manifest.json"


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory (CUDA allocator) or peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def replica_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """One float64 sum per trainable tensor: equal across ranks iff the replicas agree (to rounding)."""
    sums = [p.detach().double().sum() for p in model.parameters() if p.requires_grad]
    return torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64)


def fault_point(name: str) -> None:
    """Fault injection for the reliability tests: LYCHEE_FAULT=<name> kills this process (SIGKILL) here.

    Points: `after_step_<n>`, `during_checkpoint` (any checkpoint) / `during_checkpoint_<step>` (after
    save_state, before publish); LYCHEE_FAULT_RANK picks the rank (default 0). `nan_loss` is read in the loop.
    """
    if os.environ.get("LYCHEE_FAULT_RANK", "0") != os.environ.get("RANK", "0"):
        return
    fault = os.environ.get("LYCHEE_FAULT")
    if fault == name:
        os.kill(os.getpid(), 9)
    if fault == f"hang_{name}":  # watchdog tests: this rank goes silent (alive, no progress), e.g. hang_after_step_2
        while True:
            time.sleep(3600)
    if fault == f"exit_{name}":  # a rank that leaves early with exit code 0 while the others wait for it
        os._exit(0)


def injected_nan(step: int) -> bool:
    """Fault injection: LYCHEE_FAULT=nan_loss (every step), nan_loss_at_<k> or nan_loss_from_<k> (optimizer step k)."""
    fault = os.environ.get("LYCHEE_FAULT", "")
    if fault == "nan_loss":
        return True
    if fault.startswith("nan_loss_at_"):
        return step == int(fault.rsplit("_", 1)[1])
    if fault.startswith("nan_loss_from_"):
        return step >= int(fault.rsplit("_", 1)[1])
    return False


class NonFiniteStop(RuntimeError):
    """Too many non-finite optimizer steps in a row: the stage stops before it trains on garbage."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, type=Path)
    spec = json.loads(parser.parse_args(argv).spec.read_text())
    train, out_dir = spec["training"], Path(spec["output_dir"])

    accelerator = Accelerator(
        gradient_accumulation_steps=train["gradient_accumulation_steps"],
        # Accelerate would step a prepared scheduler once per process per optimizer step (N times too fast on
        # N processes); we step it ourselves, exactly once per optimizer step of the run.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=train["launch"]["process_group_timeout_s"]))],
    )
    logging.basicConfig(
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
        format=f"[rank {accelerator.process_index}] %(message)s",
        stream=sys.stdout,
    )
    # One line from every rank, so a failed stage can quote each rank's last words (others log warnings only).
    print(f"[rank {accelerator.process_index}] started: pid {os.getpid()}, {accelerator.num_processes} process(es), "
          f"device {accelerator.device}", flush=True)
    beat = Heartbeat(out_dir, accelerator.process_index, str(accelerator.distributed_type))  # launcher watchdog
    beat(0, "started")
    if accelerator.device.type == "cpu":
        torch.set_num_threads(train["launch"]["threads_per_process"])
    set_seed(train["seed"], device_specific=False)

    # Model and data. Every rank reads the same memory-mapped Arrow file; the sampler shards it.
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    with accelerator.main_process_first():  # the first load may build or download; the others then reuse it
        model = load_reranker(ModelConfig(**{k: v for k, v in spec["model"].items() if k in known}), accelerator.device)
    with accelerator.main_process_first():
        import datasets

        records = datasets.Dataset.from_parquet(spec["data_path"], cache_dir=str(out_dir / "hf_cache"))
    collator = GroupCollator(
        model.processor,
        group_size=train["group_size"],
        max_length=train["max_length"],
        min_pixels=train["min_pixels"],
        max_pixels=train["max_pixels"],
        seed=train["seed"],
        negative_fill=train.get("negative_fill", "refuse"),
        fill_pool=records if train.get("negative_fill") == "fill_random" else None,  # rows of the same split
    )
    schedule_pixels = [(s["start"], s["max_pixels"]) for s in train["resolution_schedule"]]
    collator.set_max_pixels(max_pixels_at(0.0, schedule_pixels, train["max_pixels"]))
    # Padded to whole global batches with zero-weight slots: every record once per epoch, on any N.
    sampler = EpochPermutation(len(records), train["seed"], accelerator.num_processes * train["per_device_batch_size"])
    trace_records = os.environ.get("LYCHEE_TRACE_RECORDS") == "1"  # tests: which records each step saw
    group_size = train["group_size"]

    def collate(slots: list[Slot]) -> dict:
        batch = collator([records[s.record] for s in slots])
        batch["group_weight"] = torch.tensor([s.weight for s in slots])
        batch["loss_scale"] = loss_scale(slots, accelerator.num_processes)
        if trace_records:  # padding slots traced as -1
            batch["record_index"] = torch.tensor([s.record if s.weight else -1 for s in slots])
        return batch

    loader = DataLoader(
        SlotDataset(len(records)),
        batch_size=train["per_device_batch_size"],
        sampler=sampler,
        # Its own generator: creating an iterator draws a seed, which must not move the global RNG
        # (dropout) or a resumed run would diverge from an uninterrupted one.
        generator=torch.Generator().manual_seed(train["seed"]),
        collate_fn=collate,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=train["learning_rate"], weight_decay=train["weight_decay"])
    steps_per_epoch = max(1, math.ceil(len(loader) / accelerator.num_processes / train["gradient_accumulation_steps"]))
    total_steps = train["max_steps"] or max(1, math.ceil(train["epochs"] * steps_per_epoch))
    schedule = Schedule.for_run(train["scheduler"], total_steps, train["warmup_ratio"], train["learning_rate"])
    scheduler = schedule.scheduler(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # Resume from the newest intact checkpoint (a half-written or corrupted one is skipped, and said so).
    ckpt_root = out_dir / "checkpoints"
    step, losses, learning_rates, skipped_steps = 0, [], [], []
    if train["resume"]:
        found, state, skipped = checkpoints.find_resumable(ckpt_root)
        for note in skipped:
            log.warning("skipping checkpoint %s", note)
        if found is not None:
            # Our own files, verified by sha256 above; tensors only (no arbitrary pickled objects).
            accelerator.load_state(str(found), load_kwargs={"weights_only": True})
            step, losses = state["step"], state["losses"]
            learning_rates, skipped_steps = state.get("learning_rates", []), state.get("skipped_steps", [])
            rebase_learning_rate(optimizer, scheduler, train["learning_rate"])
            log.info("resumed from %s at step %d (epoch %d), learning rate %.3e", found, step,
                     step // steps_per_epoch, scheduler.get_last_lr()[0])

    tracker = StageTracker(
        enabled=accelerator.is_main_process,
        run_name=spec["stage"],
        tags={"stage": spec["stage"], "devices": str(accelerator.num_processes), "device_type": accelerator.device.type},
    )
    tracker.log_params({"stage": spec["stage"], "devices": accelerator.num_processes, "model": spec["model"], "training": train})

    pairs_per_step = train["group_size"] * train["per_device_batch_size"] * train["gradient_accumulation_steps"]
    pairs_per_step *= accelerator.num_processes
    nonfinite_in_a_row, traced = 0, []
    model.train()
    started, window_start, window_tokens = time.perf_counter(), time.perf_counter(), 0
    train_time, steps_timed = 0.0, 0
    step_seconds = []  # [step, seconds] of every optimizer step, for the scaling report's equal windows
    epoch = step // steps_per_epoch
    while step < total_steps:
        # Through the prepared loader: Accelerate sets the sampler's epoch from its own counter on every
        # iteration, which would replay epoch 0's order after a resume.
        loader.set_epoch(epoch)
        collator.set_epoch(epoch)
        skip = (step - epoch * steps_per_epoch) * train["gradient_accumulation_steps"]
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip > 0 else loader
        for batch in epoch_loader:
            labels = batch.pop("labels")
            batch.pop("group_size")
            group_weight, scale = batch.pop("group_weight"), batch.pop("loss_scale")
            record_index = batch.pop("record_index", None)
            window_tokens += int(batch["attention_mask"].sum())
            if trace_records:  # every micro-batch of every rank, under the optimizer step it belongs to
                traced.append([step + 1, accelerator.gather(record_index.to(accelerator.device)).tolist()])
            with accelerator.accumulate(model):
                logits = model(**batch)
                if train["loss"] == "pointwise":
                    loss = pointwise_loss(logits, labels, group_weight.repeat_interleave(group_size))
                else:
                    loss = listwise_loss(logits, group_size, train["temperature"], weights=group_weight)
                loss = loss * scale  # the mean over the global batch's real groups (padding weighs 0)
                if injected_nan(step + 1):
                    loss = loss * float("nan")
                accelerator.backward(loss)
                if not accelerator.sync_gradients:
                    continue
                grad_norm = float(accelerator.clip_grad_norm_(trainable, train["max_grad_norm"]))
                mean_loss = accelerator.reduce(loss.detach().float(), reduction="mean").item()
                finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
                if finite:  # a non-finite loss or gradient never reaches the weights
                    optimizer.step()
                scheduler.step()  # the schedule follows the run's step, skipped or not
                optimizer.zero_grad()
            step += 1
            collator.set_max_pixels(max_pixels_at(step / total_steps, schedule_pixels, train["max_pixels"]))
            learning_rates.append([step, scheduler.get_last_lr()[0]])
            if finite:
                losses.append([step, mean_loss])
                nonfinite_in_a_row = 0
            else:
                skipped_steps.append([step, mean_loss, grad_norm])
                nonfinite_in_a_row += 1
                log.warning("step %d skipped: non-finite loss %s / gradient norm %s (%d in a row, %d in all)",
                            step, mean_loss, grad_norm, nonfinite_in_a_row, len(skipped_steps))
                tracker.log_metrics({"skipped_steps": len(skipped_steps)}, step=step)
                if nonfinite_in_a_row >= train["max_nonfinite_steps"]:
                    newest = checkpoints.list_checkpoints(ckpt_root)
                    message = (
                        f"stage {spec['stage']}: {nonfinite_in_a_row} non-finite steps in a row (steps "
                        f"{step - nonfinite_in_a_row + 1}-{step}); last finite checkpoint: "
                        f"{newest[0] if newest else 'none'}; resume with training.resume=true and a lower "
                        "training.learning_rate"
                    )
                    log.error("%s", message)
                    raise NonFiniteStop(message)
            now = time.perf_counter()
            elapsed, window_start = now - window_start, now
            tokens = accelerator.reduce(torch.tensor(window_tokens, device=accelerator.device), reduction="sum").item()
            window_tokens = 0
            step_seconds.append([step, elapsed])
            if step > 1:  # the first step carries warm-up cost; rates come from the rest
                train_time, steps_timed = train_time + elapsed, steps_timed + 1
            if accelerator.is_main_process and (step % train["log_every"] == 0 or step == total_steps):
                figures = {
                    "loss": mean_loss,
                    "learning_rate": scheduler.get_last_lr()[0],
                    "pairs_per_s": pairs_per_step / elapsed,
                    "tokens_per_s": tokens / elapsed,
                    "peak_mem_gib": peak_memory_gib(accelerator.device),
                    "grad_norm": grad_norm,
                }
                tracker.log_metrics({k: v for k, v in figures.items() if math.isfinite(v)}, step=step)
                eta = (total_steps - step) * (now - started) / max(1, step)
                log.info(
                    "step %d/%d loss %.4f lr %.2e pairs/s %.1f tokens/s %.0f ETA %ds",
                    step, total_steps, mean_loss, figures["learning_rate"], figures["pairs_per_s"],
                    figures["tokens_per_s"], int(eta),
                )
            # Never inside a run of non-finite steps: the newest checkpoint stays the last finite one.
            if step % train["checkpoint_every"] == 0 and step < total_steps and nonfinite_in_a_row == 0:
                state = {"step": step, "losses": losses, "learning_rates": learning_rates,
                         "skipped_steps": skipped_steps}
                save_checkpoint(accelerator, ckpt_root, step, state, train["keep_last"])
            beat(step, "step")
            fault_point(f"after_step_{step}")
            if step >= total_steps:
                break
        epoch += 1

    beat(step, "finishing")
    # Replicas must agree after DDP steps; gather one fingerprint per rank and compare.
    fingerprints = accelerator.gather(replica_fingerprint(accelerator.unwrap_model(model)).unsqueeze(0))
    replica_diff = (fingerprints - fingerprints[0]).abs().max().item()
    peak = accelerator.gather(torch.tensor([peak_memory_gib(accelerator.device)], device=accelerator.device))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        adapter_dir = out_dir / "adapter"
        # Saved with the adapter: evaluation, the MLflow model and Reranker.from_pretrained score with these.
        trained_with = ProcessingConfig(max_length=train["max_length"], min_pixels=train["min_pixels"],
                                        max_pixels=max_pixels_at(1.0, schedule_pixels, train["max_pixels"]))
        accelerator.unwrap_model(model).save_pretrained(adapter_dir, processing=trained_with)
        # sha256 of every adapter file: a re-run reuses this stage only while they still match.
        checkpoints.write_folder_manifest(adapter_dir, out_dir / ADAPTER_MANIFEST)
        wall = time.perf_counter() - started
        result = {
            "stage": spec["stage"],
            "devices": accelerator.num_processes,
            "device_type": accelerator.device.type,
            "steps": step,
            "train_pairs": step * pairs_per_step,
            "full_train_pairs": len(records) * train["group_size"],  # one epoch over the training split
            "wall_time_s": wall,
            "pairs_per_s": (steps_timed * pairs_per_step / train_time) if steps_timed else step * pairs_per_step / wall,
            "peak_mem_gib": peak.tolist(),
            "step_seconds": step_seconds,
            "losses": losses,
            "learning_rates": learning_rates,
            "schedule": dataclasses.asdict(schedule),
            "skipped_steps": skipped_steps,
            "final_loss": losses[-1][1] if losses else float("nan"),
            "replica_max_diff": replica_diff,
            "truncation": collator.stats.as_dict(),
            "processing": trained_with.as_dict(),
            "negative_fill": collator.fill_stats.as_dict(),  # rank 0's groups (filled_slots: random negatives)
            "adapter_dir": str(adapter_dir),
            "adapter_manifest": str(out_dir / ADAPTER_MANIFEST),
            "spec_hash": spec.get("spec_hash"),
            "mlflow_run_id": tracker.run_id,
            "tracking_failures": tracker.failures,
        }
        if trace_records:
            result["records_seen"] = traced
        tracker.log_metrics({"final_loss": result["final_loss"], "stage_pairs_per_s": result["pairs_per_s"],
                             "replica_max_diff": replica_diff, "wall_time_s": wall})
        tracker.log_artifacts(str(adapter_dir), "adapter")
        tracker.end()
        tmp = out_dir / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out_dir / "result.json")
        log.info("stage %s done: %d steps, %.1f pairs/s, final loss %.4f", spec["stage"], step, result["pairs_per_s"],
                 result["final_loss"])
    accelerator.wait_for_everyone()  # ranks leave together: a rank that exits early can hang in gloo teardown
    beat(step, "leaving")  # past the final barrier: the launcher treats a hang from here on as teardown
    fault_point("before_end_training")
    accelerator.end_training()
    beat(step, "done")
    return 0


def rebase_learning_rate(optimizer, scheduler, learning_rate: float) -> None:
    """After a resume, a changed `training.learning_rate` takes effect on the restored schedule (at its step)."""
    inner = getattr(scheduler, "scheduler", scheduler)
    if all(abs(b - learning_rate) <= 1e-12 * learning_rate for b in inner.base_lrs):
        return
    log.info("learning rate changed on resume: %s -> %.3e", inner.base_lrs, learning_rate)
    inner.base_lrs = [learning_rate] * len(inner.base_lrs)
    for group, factor in zip(optimizer.param_groups, inner.lr_lambdas):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(inner.last_epoch)
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, state: dict, keep_last: int) -> None:
    """All ranks write into a staging folder; the main process checksums it and renames it into place."""
    tmp = checkpoints.staging_dir(root, step)
    accelerator.save_state(str(tmp))
    fault_point("during_checkpoint")
    fault_point(f"during_checkpoint_{step}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoints.publish(root, step, state)
        checkpoints.prune(root, keep_last)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    sys.exit(main())
