"""The training entry point every process of a stage runs: `python -m lychee_pipeline.training.train --spec F`.

`run(spec)` reads top to bottom: set up (model, data, optimizer and schedule prepared by Accelerate), resume,
the epoch/step loop, finish (replica check, adapter, result.json on rank 0). Its named pieces: the step
(`training/step.py`), the step log (`training/step_log.py`: read-back windows, rates, MLflow step metrics), the
fault hooks (`training/faults.py`), the result (`stage_result`). Needs torch, transformers, peft, accelerate
and datasets; MLflow only if it is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from lychee_pipeline.host import cpus_available
from lychee_pipeline.reranker import GroupCollator, load_reranker
from lychee_pipeline.reranker.collate import max_pixels_at, sample_group
from lychee_pipeline.reranker.kernels import fused_kernels_applied
from lychee_pipeline.reranker.lora_branch import fused_branches
from lychee_pipeline.reranker.losses import get_loss
from lychee_pipeline.reranker.processing import ProcessingConfig
from lychee_pipeline.tracking import StageTracker
from lychee_pipeline.training import checkpoints, faults, memory
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.runtime.heartbeat import Heartbeat  # read by the launcher's watchdog (runtime/watchdog.py)
from lychee_pipeline.training.sampling import EpochPermutation, Slot, SlotDataset, loss_scale
from lychee_pipeline.training.schedule import Schedule
from lychee_pipeline.training.stage import RESULT_FILE, StageResult, StageSpec
from lychee_pipeline.training.step import MicroBatch, TrainStep
from lychee_pipeline.training.step_log import StepLog, peak_memory_gib

log = logging.getLogger("lychee_pipeline.training.train")

ADAPTER_MANIFEST = "adapter.manifest.json"


class StageCollate:
    """Slots of one micro-batch -> the model batch; a pure function of the slots, so it can run in any worker.

    ``tokens`` (real tokens of the batch, counted on the host) and the batch's truncation counts travel with the
    batch, so the training loop never has to read them back from the device and no count is lost in a worker.
    """

    def __init__(self, records, collator: GroupCollator, train: TrainingParams, steps_per_epoch: int, total_steps: int,
                 num_processes: int, trace: bool):
        self.records, self.collator, self.trace, self.num_processes = records, collator, trace, num_processes
        self.schedule = [(s.start, s.max_pixels) for s in train.resolution_schedule]
        self.max_pixels = train.max_pixels
        # micro-batches of the whole run (all ranks) per optimizer step: Accelerate deals batches round-robin
        self.batches_per_step = train.per_device_batch_size, num_processes * train.gradient_accumulation_steps
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps

    def step_of(self, epoch: int, position: int) -> int:
        """Optimizer steps done before the step this record's batch belongs to."""
        batch_size, per_step = self.batches_per_step
        return epoch * self.steps_per_epoch + (position // batch_size) // per_step

    def __call__(self, slots: list[Slot]) -> dict:
        epoch, position = slots[0].epoch, slots[0].position
        done = self.step_of(epoch, position)
        self.collator.set_epoch(epoch)
        self.collator.set_max_pixels(max_pixels_at(done / self.total_steps, self.schedule, self.max_pixels))
        before = self.collator.stats.as_dict()
        batch = self.collator([self.records[s.record] for s in slots])
        after = self.collator.stats.as_dict()
        batch["truncation"] = {k: after[k] - before[k] for k in after}
        batch["tokens"] = int(batch["attention_mask"].sum())
        batch["group_weight"] = torch.tensor([s.weight for s in slots])  # 0 for an epoch's padding slots
        batch["loss_scale"] = loss_scale(slots, self.num_processes)
        if self.trace:  # padding slots traced as -1
            batch["record_index"] = torch.tensor([s.record if s.weight else -1 for s in slots])
        return batch


def replica_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """One float64 sum per trainable tensor: equal across ranks iff the replicas agree (to rounding)."""
    sums = [p.detach().double().sum() for p in model.parameters() if p.requires_grad]
    return torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64)


def resolve_activation_checkpointing(model, collator: GroupCollator, records, train: TrainingParams,
                                     pairs_per_micro_batch: int, sample: int = 64) -> memory.CheckpointChoice:
    """``model.activation_checkpointing: auto``: measure the longest pairs of a sample of records (the collator's
    own token count, at the largest pixel budget of the run) and pick the checkpointed layers from the budget."""
    budgets = [train.max_pixels] + [s.max_pixels for s in train.resolution_schedule]
    saved = collator.pairs.max_pixels
    collator.set_max_pixels(max(budgets))
    order = EpochPermutation(len(records), train.seed)
    keys = [slot.record for slot in list(order)[: min(sample, len(records))]]
    lengths = []
    for i in keys:
        group = sample_group(records[int(i)], collator.group_size, 0, collator.seed, fill_pool=collator.fill_pool)
        lengths += [collator.pairs.measure(pair) for pair in collator.group_pairs(group)]
    collator.set_max_pixels(saved)
    decoder_layers = model.family.decoder_layers
    hf = model.base_model
    text = getattr(hf.config, "text_config", hf.config)
    packed = bool(model.config.pack_pairs)
    tokens = memory.longest_micro_batch_tokens(lengths, pairs_per_micro_batch, packed=packed)
    costs = memory.activation_costs(packed=packed, fused=fused_kernels_applied(model),
                                    lora_branch=fused_branches(model) > 0)
    return memory.choose_checkpoint_layers(tokens, int(text.hidden_size), len(decoder_layers(hf)),
                                           memory.weights_bytes(model), train.memory_budget_gib, costs=costs)


def run(spec: StageSpec) -> StageResult | None:
    """One stage in this process: set up, resume, the epoch/step loop, finish. Rank 0 returns the result."""
    train, out_dir = spec.training, Path(spec.output_dir)
    accelerator = stage_accelerator(train)
    beat = start_process(accelerator, train, out_dir)

    # Set up: model and data (every rank memory-maps the same Arrow file; the sampler shards it), optimizer, schedule.
    model, records, collator, checkpoint_choice = load_model_and_data(spec, accelerator)
    # Padded to whole global batches with zero-weight slots: every record once per epoch, on any N.
    sampler = EpochPermutation(len(records), train.seed, accelerator.num_processes * train.per_device_batch_size)
    batches = len(sampler) // train.per_device_batch_size
    steps_per_epoch = max(1, math.ceil(batches / accelerator.num_processes / train.gradient_accumulation_steps))
    total_steps = train.max_steps or max(1, math.ceil(train.epochs * steps_per_epoch))
    trace_records = os.environ.get("LYCHEE_TRACE_RECORDS") == "1"  # tests: which records each step saw
    collate = StageCollate(records, collator, train, steps_per_epoch, total_steps, accelerator.num_processes,
                           trace_records)
    loader, loader_kwargs = stage_loader(sampler, collate, train, accelerator.device.type)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Fused AdamW skips a non-finite step on the device (training/step.py); DDP only: the DeepSpeed / FSDP
    # templates wrap the optimizer, and there the check stays on the host, every step.
    skip_on_device = train.launch.strategy == "ddp"
    optimizer = torch.optim.AdamW(trainable, lr=train.learning_rate, weight_decay=train.weight_decay,
                                  **({"fused": True} if skip_on_device else {}))
    schedule = Schedule.for_run(train.scheduler, total_steps, train.warmup_ratio, train.learning_rate)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, schedule.scheduler(optimizer))

    # Resume from the newest intact checkpoint (a half-written or corrupted one is skipped, and said so).
    checkpoint_root = out_dir / "checkpoints"
    step, resumed = resume(accelerator, checkpoint_root, train, optimizer, scheduler, steps_per_epoch)
    tracker = open_tracker(spec, accelerator)  # a nested MLflow run, written by rank 0
    pairs_per_step = (train.group_size * train.per_device_batch_size * train.gradient_accumulation_steps
                      * accelerator.num_processes)
    # a loss from a user's module is registered by now: reading the spec imported `training.loss_modules`
    train_step = TrainStep(accelerator, model, optimizer, scheduler, trainable, get_loss(train.loss),
                           train.loss_options(), train.max_grad_norm, skip_on_device)
    model.train()
    step_log = StepLog(accelerator, scheduler, tracker, train, spec.stage, total_steps, pairs_per_step,
                       checkpoint_root, skip_on_device, list(collator.stats.as_dict()), resumed, step + 1,
                       trace_records)

    # The loop. Set-up is done: move what exists now (the model's many Python objects above all) into the
    # collector's permanent generation, so full collections during the loop stop walking it. On one H200 the
    # stage spent 775 ms in 597 collections over 40 steps against the isolated step's 61 ms, about half of the
    # 34 ms a step between them at 850 tokens/pair (docs/benchmarks.md, 2026-12-03).
    gc.freeze()
    epoch = step // steps_per_epoch
    while step < total_steps:
        # Through the prepared loader: Accelerate sets the sampler's epoch from its own counter on every
        # iteration, which would replay epoch 0's order after a resume.
        loader.set_epoch(epoch)
        skip = (step - epoch * steps_per_epoch) * train.gradient_accumulation_steps
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip > 0 else loader
        for batch in step_log.timing.batches(epoch_loader):
            micro_batch = MicroBatch.of(batch)
            step_log.count(micro_batch, step)
            figures = train_step(micro_batch, nan_fault=faults.injected_nan(step + 1))
            if figures is None:  # inside an accumulation: no optimizer step yet
                step_log.timing.micro_batch_issued()
                continue
            step += 1
            checkpoint_due = step % train.checkpoint_every == 0 and step < total_steps
            step_log.step_issued(step, figures, checkpoint_due)
            # Never inside a run of non-finite steps: the newest checkpoint stays the last finite one.
            if checkpoint_due and step_log.nonfinite_in_a_row == 0:
                save_checkpoint(accelerator, checkpoint_root, step, step_log.checkpoint_state(step), train.keep_last)
            with step_log.timing.heartbeat():
                beat(step, "step", total=total_steps)  # also the launcher's progress bar (runtime/progress.py)
            faults.fault_point(f"after_step_{step}")
            if step >= total_steps:
                break
        epoch += 1

    # Finish: replicas compared, the adapter saved and the result written by rank 0; the ranks leave together.
    step_timing = step_log.close(step)
    beat(step, "finishing")
    replica_diff, peaks = compare_replicas(accelerator, model)
    result = None
    if accelerator.is_main_process:
        processing = save_adapter(accelerator, model, out_dir, train)
        result = stage_result(spec, accelerator, step_log, step, wall=time.perf_counter() - step_log.started,
                              records=len(records), peaks=peaks, replica_diff=replica_diff, schedule=schedule,
                              processing=processing, negative_fill=collator.fill_stats.as_dict(),
                              dataloader=loader_kwargs, timing=step_timing, checkpointing=checkpoint_choice,
                              tracker=tracker)
        report(result, tracker, out_dir, step_timing)
    accelerator.wait_for_everyone()  # ranks leave together: a rank that exits early can hang in gloo teardown
    beat(step, "leaving")  # past the final barrier: the launcher treats a hang from here on as teardown
    faults.fault_point("before_end_training")
    accelerator.end_training()
    beat(step, "done")
    return result


def stage_accelerator(train: TrainingParams) -> Accelerator:
    return Accelerator(
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # batches come from pinned memory (on CUDA) and are copied while the previous step still runs
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        # Accelerate would step a prepared scheduler once per process per optimizer step (N times too fast on
        # N processes); we step it ourselves, exactly once per optimizer step of the run.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=train.launch.process_group_timeout_s))],
    )


def start_process(accelerator: Accelerator, train: TrainingParams, out_dir: Path) -> Heartbeat:
    """This process's log format, its first line, its heartbeat (read by the launcher's watchdog), threads, seed."""
    logging.basicConfig(
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
        format=f"[rank {accelerator.process_index}] %(message)s",
        stream=sys.stdout,
    )
    # Accelerate logs six INFO lines per checkpoint ("Saving current state to ...", "Model weights saved in ...");
    # the checkpoint folders say as much. Its warnings and errors still reach launch.log and the run's log.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    # One line from every rank, so a failed stage can quote each rank's last words (others log warnings only).
    print(f"[rank {accelerator.process_index}] started: pid {os.getpid()}, {accelerator.num_processes} process(es), "
          f"device {accelerator.device}", flush=True)
    beat = Heartbeat(out_dir, accelerator.process_index, str(accelerator.distributed_type))  # launcher watchdog
    beat(0, "started")
    beat.on_uncaught_exception()
    if accelerator.device.type == "cpu":
        torch.set_num_threads(train.launch.threads_per_process)
    set_seed(train.seed, device_specific=False)
    return beat


def load_model_and_data(spec: StageSpec, accelerator: Accelerator):
    """The reranker, the training records, their collator, and the activation checkpointing ``auto`` chose."""
    train = spec.training
    # activation_checkpointing "auto" (QLoRA aside) is decided below, once the model's size and the data's
    # longest batch are known; loading leaves it off (ModelConfig.checkpointing_at_load)
    auto_checkpointing = spec.model.activation_checkpointing == "auto"
    with accelerator.main_process_first():  # the first load may build or download; the others then reuse it
        model = load_reranker(spec.model, accelerator.device)
    with accelerator.main_process_first():
        import datasets

        records = datasets.Dataset.from_parquet(spec.data_path, cache_dir=str(Path(spec.output_dir) / "hf_cache"))
    collator = GroupCollator(
        model.processor,
        group_size=train.group_size,
        max_length=train.max_length,
        min_pixels=train.min_pixels,
        max_pixels=train.max_pixels,
        seed=train.seed,
        negative_fill=train.negative_fill,
        fill_pool=records if train.negative_fill == "fill_random" else None,  # rows of the same split
        family=model.family.NAME,  # the model's prompt and image-token rule
    )
    checkpoint_choice = None
    if auto_checkpointing and spec.model.finetune != "qlora":
        pairs_per_micro_batch = train.group_size * train.per_device_batch_size
        checkpoint_choice = resolve_activation_checkpointing(model, collator, records, train, pairs_per_micro_batch)
        model.family.apply_selective_checkpointing(model, layers=checkpoint_choice.layers)
        (log.info if checkpoint_choice.fits else log.warning)("%s", checkpoint_choice.describe())
    return model, records, collator, checkpoint_choice


def stage_loader(sampler: EpochPermutation, collate: StageCollate, train: TrainingParams,
                 device_type: str) -> tuple[DataLoader, dict]:
    """The stage's DataLoader over the sampler's slots, and the worker settings it resolved to."""
    loader_kwargs = memory.resolve_dataloader(train.dataloader.model_dump(), device_type,
                                              cpus_available(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    log.info("data loader: %s", ", ".join(f"{k}={v}" for k, v in loader_kwargs.items()))
    loader = DataLoader(
        SlotDataset(len(sampler)),
        batch_size=train.per_device_batch_size,
        sampler=sampler,
        # Its own generator: creating an iterator draws a seed, which must not move the global RNG
        # (dropout) or a resumed run would diverge from an uninterrupted one.
        generator=torch.Generator().manual_seed(train.seed),
        collate_fn=collate,
        **loader_kwargs,
    )
    return loader, loader_kwargs


def resume(accelerator: Accelerator, root: Path, train: TrainingParams, optimizer, scheduler,
           steps_per_epoch: int) -> tuple[int, dict]:
    """With ``training.resume``: the newest intact checkpoint's state loaded; its step and saved history."""
    if not train.resume:
        return 0, {}
    found, state, skipped = checkpoints.find_resumable(root)
    for note in skipped:
        log.warning("skipping checkpoint %s", note)
    if found is None:
        return 0, {}
    # Our own files, verified by sha256 above; tensors only (no arbitrary pickled objects).
    accelerator.load_state(str(found), load_kwargs={"weights_only": True})
    rebase_learning_rate(optimizer, scheduler, train.learning_rate)
    step = state["step"]
    log.info("resumed from %s at step %d (epoch %d), learning rate %.3e", found, step, step // steps_per_epoch,
             scheduler.get_last_lr()[0])
    return step, state


def open_tracker(spec: StageSpec, accelerator: Accelerator) -> StageTracker:
    tracker = StageTracker(
        enabled=accelerator.is_main_process,
        run_name=spec.stage,
        tags={"stage": spec.stage, "devices": str(accelerator.num_processes), "device_type": accelerator.device.type},
    )
    tracker.log_params({"stage": spec.stage, "devices": accelerator.num_processes,
                        "model": dataclasses.asdict(spec.model), "training": spec.training})
    return tracker


def compare_replicas(accelerator: Accelerator, model) -> tuple[float, list[float]]:
    """Replicas must agree after DDP steps: one fingerprint per rank, compared; and each rank's peak memory."""
    fingerprints = accelerator.gather(replica_fingerprint(accelerator.unwrap_model(model)).unsqueeze(0))
    replica_diff = (fingerprints - fingerprints[0]).abs().max().item()
    peak = accelerator.gather(torch.tensor([peak_memory_gib(accelerator.device)], device=accelerator.device))
    accelerator.wait_for_everyone()
    return replica_diff, peak.tolist()


def save_adapter(accelerator: Accelerator, model, out_dir: Path, train: TrainingParams) -> ProcessingConfig:
    """The trained adapter with the processing settings it was trained with, and its files' sha256 manifest."""
    # Saved with the adapter: evaluation, the MLflow model and Reranker.from_pretrained score with these.
    schedule = [(s.start, s.max_pixels) for s in train.resolution_schedule]
    trained_with = ProcessingConfig(max_length=train.max_length, min_pixels=train.min_pixels,
                                    max_pixels=max_pixels_at(1.0, schedule, train.max_pixels))
    accelerator.unwrap_model(model).save_pretrained(out_dir / "adapter", processing=trained_with)
    # sha256 of every adapter file: a re-run reuses this stage only while they still match.
    checkpoints.write_folder_manifest(out_dir / "adapter", out_dir / ADAPTER_MANIFEST)
    return trained_with


def stage_result(spec: StageSpec, accelerator: Accelerator, step_log: StepLog, step: int, *, wall: float,
                 records: int, peaks: list[float], replica_diff: float, schedule: Schedule,
                 processing: ProcessingConfig, negative_fill: dict, dataloader: dict, timing: dict,
                 checkpointing: memory.CheckpointChoice | None, tracker: StageTracker) -> StageResult:
    """What the stage did, as rank 0 reports it."""
    train, out_dir = spec.training, Path(spec.output_dir)
    pairs_per_step = step_log.pairs_per_step
    return StageResult(
        stage=spec.stage,
        devices=accelerator.num_processes,
        device_type=accelerator.device.type,
        steps=step,
        train_pairs=step * pairs_per_step,
        full_train_pairs=records * train.group_size,  # one epoch over the training split
        wall_time_s=wall,
        pairs_per_s=step_log.pairs_per_s(step, wall),
        peak_mem_gib=peaks,
        step_seconds=step_log.step_seconds,
        losses=step_log.losses,
        learning_rates=step_log.learning_rates,
        schedule=dataclasses.asdict(schedule),
        skipped_steps=step_log.skipped_steps,
        final_loss=step_log.losses[-1][1] if step_log.losses else float("nan"),
        replica_max_diff=replica_diff,
        truncation=step_log.truncation,
        processing=processing,
        negative_fill=negative_fill,  # rank 0's groups (filled_slots: random negatives)
        dataloader=dataloader,
        timing=timing,  # training.step_timing: data wait, host issue, device span/gaps per step
        activation_checkpointing=(dataclasses.asdict(checkpointing) if checkpointing is not None
                                  else spec.model.activation_checkpointing),
        adapter_dir=str(out_dir / "adapter"),
        adapter_manifest=str(out_dir / ADAPTER_MANIFEST),
        spec_hash=spec.spec_hash,
        mlflow_run_id=tracker.run_id,
        tracking_failures=tracker.failures,
        records_seen=step_log.traced,
    )


def report(result: StageResult, tracker: StageTracker, out_dir: Path, step_timing: dict) -> None:
    """Rank 0: the stage's figures and adapter to its MLflow run, result.json written, two log lines."""
    tracker.log_metrics({"final_loss": result.final_loss, "stage_pairs_per_s": result.pairs_per_s,
                         "replica_max_diff": result.replica_max_diff, "wall_time_s": result.wall_time_s})
    tracker.log_artifacts(result.adapter_dir, "adapter")
    tracker.end()
    result.write(out_dir / RESULT_FILE)
    log.info("stage %s done: %d steps, %.1f pairs/s, final loss %.4f", result.stage, result.steps, result.pairs_per_s,
             result.final_loss)
    log.info("step time (steps %s-%s): %s", step_timing.get("first_step"), step_timing.get("last_step"),
             ", ".join(f"{k} {v:.3g}" for k, v in step_timing.items() if isinstance(v, float)))


def main(argv: list[str] | None = None) -> int:
    """What ``accelerate launch -m lychee_pipeline.training.train --spec F`` runs in every process."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, type=Path)
    run(StageSpec.read(parser.parse_args(argv).spec))  # an unknown or missing field: one error, before any work
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
    faults.fault_point("during_checkpoint")
    faults.fault_point(f"during_checkpoint_{step}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoints.publish(root, step, state)
        checkpoints.prune(root, keep_last)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    sys.exit(main())
