"""The training entry point every process of a stage runs: `python -m lychee_pipeline.training.train --spec F`.

One readable loop, top to bottom: read the spec, prepare model / optimizer / scheduler / dataloader with
Accelerate, loop with gradient accumulation, log and checkpoint on the main process, write result.json.
Needs torch, transformers, peft, accelerate and datasets; MLflow only if it is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import resource
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
from lychee_pipeline.reranker.losses import get_loss
from lychee_pipeline.reranker.processing import ProcessingConfig
from lychee_pipeline.tracking import StageTracker
from lychee_pipeline.training import checkpoints, memory
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.runtime.heartbeat import Heartbeat  # read by the launcher's watchdog (runtime/watchdog.py)
from lychee_pipeline.training.sampling import EpochPermutation, Slot, SlotDataset, loss_scale
from lychee_pipeline.training.schedule import Schedule
from lychee_pipeline.training.stage import RESULT_FILE, StageResult, StageSpec
from lychee_pipeline.training.step_timing import StepTiming

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
    from lychee_pipeline.reranker.families.qwen2_5_vl import decoder_layers

    hf = model.base_model
    text = getattr(hf.config, "text_config", hf.config)
    tokens = memory.longest_micro_batch_tokens(lengths, pairs_per_micro_batch, packed=bool(model.config.pack_pairs))
    return memory.choose_checkpoint_layers(tokens, int(text.hidden_size), len(decoder_layers(hf)),
                                           memory.weights_bytes(model), train.memory_budget_gib)


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
    spec = StageSpec.read(parser.parse_args(argv).spec)  # an unknown or missing field: one error, before any work
    train, out_dir = spec.training, Path(spec.output_dir)

    accelerator = Accelerator(
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # batches come from pinned memory (on CUDA) and are copied while the previous step still runs
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        # Accelerate would step a prepared scheduler once per process per optimizer step (N times too fast on
        # N processes); we step it ourselves, exactly once per optimizer step of the run.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=train.launch.process_group_timeout_s))],
    )
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

    # Model and data. Every rank reads the same memory-mapped Arrow file; the sampler shards it.
    # activation_checkpointing "auto" (QLoRA aside) is decided below, once the model's size and the data's
    # longest batch are known; loading leaves it off (ModelConfig.checkpointing_at_load)
    auto_checkpointing = spec.model.activation_checkpointing == "auto"
    with accelerator.main_process_first():  # the first load may build or download; the others then reuse it
        model = load_reranker(spec.model, accelerator.device)
    with accelerator.main_process_first():
        import datasets

        records = datasets.Dataset.from_parquet(spec.data_path, cache_dir=str(out_dir / "hf_cache"))
    collator = GroupCollator(
        model.processor,
        group_size=train.group_size,
        max_length=train.max_length,
        min_pixels=train.min_pixels,
        max_pixels=train.max_pixels,
        seed=train.seed,
        negative_fill=train.negative_fill,
        fill_pool=records if train.negative_fill == "fill_random" else None,  # rows of the same split
    )
    pairs_per_micro_batch = train.group_size * train.per_device_batch_size
    checkpoint_choice = None
    if auto_checkpointing and spec.model.finetune != "qlora":
        checkpoint_choice = resolve_activation_checkpointing(model, collator, records, train, pairs_per_micro_batch)
        from lychee_pipeline.reranker.families.qwen2_5_vl import apply_selective_checkpointing

        apply_selective_checkpointing(model, layers=checkpoint_choice.layers)
        (log.info if checkpoint_choice.fits else log.warning)("%s", checkpoint_choice.describe())
    # Padded to whole global batches with zero-weight slots: every record once per epoch, on any N.
    sampler = EpochPermutation(len(records), train.seed, accelerator.num_processes * train.per_device_batch_size)
    trace_records = os.environ.get("LYCHEE_TRACE_RECORDS") == "1"  # tests: which records each step saw
    # a loss from a user's module is registered by now: reading the spec imported `training.loss_modules`
    compute_loss, loss_options = get_loss(train.loss), train.loss_options()
    batches = len(sampler) // train.per_device_batch_size
    steps_per_epoch = max(1, math.ceil(batches / accelerator.num_processes / train.gradient_accumulation_steps))
    total_steps = train.max_steps or max(1, math.ceil(train.epochs * steps_per_epoch))
    collate = StageCollate(records, collator, train, steps_per_epoch, total_steps, accelerator.num_processes,
                           trace_records)
    loader_kwargs = memory.resolve_dataloader(train.dataloader.model_dump(), accelerator.device.type,
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
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Fused AdamW skips a step on the device when told the loss or gradient is not finite (`found_inf`, as
    # GradScaler does), so the loop need not read anything back from the GPU before stepping. DDP only: the
    # DeepSpeed / FSDP templates wrap the optimizer, and there the check stays on the host, every step.
    device_skip = train.launch.strategy == "ddp"
    optimizer = torch.optim.AdamW(trainable, lr=train.learning_rate, weight_decay=train.weight_decay,
                                  **({"fused": True} if device_skip else {}))
    schedule = Schedule.for_run(train.scheduler, total_steps, train.warmup_ratio, train.learning_rate)
    scheduler = schedule.scheduler(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # Resume from the newest intact checkpoint (a half-written or corrupted one is skipped, and said so).
    ckpt_root = out_dir / "checkpoints"
    step, losses, learning_rates, skipped_steps = 0, [], [], []
    if train.resume:
        found, state, skipped = checkpoints.find_resumable(ckpt_root)
        for note in skipped:
            log.warning("skipping checkpoint %s", note)
        if found is not None:
            # Our own files, verified by sha256 above; tensors only (no arbitrary pickled objects).
            accelerator.load_state(str(found), load_kwargs={"weights_only": True})
            step, losses = state["step"], state["losses"]
            learning_rates, skipped_steps = state.get("learning_rates", []), state.get("skipped_steps", [])
            rebase_learning_rate(optimizer, scheduler, train.learning_rate)
            log.info("resumed from %s at step %d (epoch %d), learning rate %.3e", found, step,
                     step // steps_per_epoch, scheduler.get_last_lr()[0])

    tracker = StageTracker(
        enabled=accelerator.is_main_process,
        run_name=spec.stage,
        tags={"stage": spec.stage, "devices": str(accelerator.num_processes), "device_type": accelerator.device.type},
    )
    tracker.log_params({"stage": spec.stage, "devices": accelerator.num_processes,
                        "model": dataclasses.asdict(spec.model), "training": train})

    pairs_per_step = train.group_size * train.per_device_batch_size * train.gradient_accumulation_steps
    pairs_per_step *= accelerator.num_processes
    nonfinite_in_a_row, traced = 0, []
    truncation = {k: 0 for k in collator.stats.as_dict()}  # summed from the batches (collated in any process)
    inner_optimizer = getattr(optimizer, "optimizer", optimizer)
    # Steps whose loss and gradient norm are still on the device: read back together (one sync) at the next
    # logging step, checkpoint, the first and the last step; every step when the skip check is on the host.
    pending: list[tuple[int, torch.Tensor]] = []
    model.train()
    started = time.perf_counter()
    window_start, window_steps = started, 0  # since the last read-back (rates of the result)
    log_start, log_steps, window_tokens = started, 0, 0  # since the last logging step
    train_time, steps_timed = 0.0, 0
    step_seconds = []  # [step, seconds] of every optimizer step, for the scaling report's equal windows
    last = {"loss": float("nan"), "grad_norm": float("nan")}
    # Where each step's time goes (data wait, host issue, device span and gaps), read without per-step syncs.
    timing, first_step = StepTiming(accelerator.device), step + 1

    def read_back() -> None:
        """Move the pending steps' figures to the host: losses, skipped steps, the non-finite stop."""
        nonlocal nonfinite_in_a_row
        if not pending:
            return
        values = torch.stack([v for _, v in pending]).tolist()  # the one host synchronisation
        for (done, _), (mean_loss, grad_norm) in zip(pending, values):
            last.update(loss=mean_loss, grad_norm=grad_norm)
            if math.isfinite(mean_loss) and math.isfinite(grad_norm):
                losses.append([done, mean_loss])
                nonfinite_in_a_row = 0
                continue
            skipped_steps.append([done, mean_loss, grad_norm])
            nonfinite_in_a_row += 1
            log.warning("step %d skipped: non-finite loss %s / gradient norm %s (%d in a row, %d in all)",
                        done, mean_loss, grad_norm, nonfinite_in_a_row, len(skipped_steps))
            tracker.log_metrics({"skipped_steps": len(skipped_steps)}, step=done)
            if nonfinite_in_a_row >= train.max_nonfinite_steps:
                newest = checkpoints.list_checkpoints(ckpt_root)
                message = (
                    f"stage {spec.stage}: {nonfinite_in_a_row} non-finite steps in a row (steps "
                    f"{done - nonfinite_in_a_row + 1}-{done}); last finite checkpoint: "
                    f"{newest[0] if newest else 'none'}; resume with training.resume=true and a lower "
                    "training.learning_rate"
                )
                log.error("%s", message)
                raise NonFiniteStop(message)
        pending.clear()

    # Set-up is done: move what exists now (the model's many Python objects above all) into the collector's
    # permanent generation, so full collections during the loop stop walking it. On one H200 the stage spent
    # 775 ms in 597 collections over 40 steps against the isolated step's 61 ms, about half of the 34 ms a step
    # between them at 850 tokens/pair (docs/benchmarks.md, 2026-12-03).
    gc.freeze()
    epoch = step // steps_per_epoch
    while step < total_steps:
        # Through the prepared loader: Accelerate sets the sampler's epoch from its own counter on every
        # iteration, which would replay epoch 0's order after a resume.
        loader.set_epoch(epoch)
        skip = (step - epoch * steps_per_epoch) * train.gradient_accumulation_steps
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip > 0 else loader
        for batch in timing.batches(epoch_loader):
            labels = batch.pop("labels")
            batch.pop("group_size")
            group_weight, scale = batch.pop("group_weight"), batch.pop("loss_scale")
            record_index = batch.pop("record_index", None)
            window_tokens += int(batch.pop("tokens"))  # counted by the collator on the host: no device sync
            for key, count in batch.pop("truncation").items():
                truncation[key] += int(count)
            if trace_records:  # every micro-batch of every rank, under the optimizer step it belongs to
                traced.append([step + 1, accelerator.gather(record_index.to(accelerator.device)).tolist()])
            with accelerator.accumulate(model):
                logits = model(**batch)
                loss = compute_loss(logits, labels, group_weight, loss_options)
                loss = loss * scale  # the mean over the global batch's real groups (padding weighs 0)
                if injected_nan(step + 1):
                    loss = loss * float("nan")
                accelerator.backward(loss)
                if not accelerator.sync_gradients:
                    timing.micro_batch_issued()
                    continue
                grad_norm = torch.as_tensor(accelerator.clip_grad_norm_(trainable, train.max_grad_norm),
                                            device=accelerator.device).float()
                mean_loss = accelerator.reduce(loss.detach().float(), reduction="mean")
                figures = torch.stack([mean_loss, grad_norm.reshape(())])
                if device_skip:  # a non-finite loss or gradient never reaches the weights, decided on the device
                    inner_optimizer.found_inf = (~torch.isfinite(figures).all()).float()
                    optimizer.step()
                elif all(math.isfinite(v) for v in figures.tolist()):
                    optimizer.step()
                scheduler.step()  # the schedule follows the run's step, skipped or not
                optimizer.zero_grad()
            step += 1
            timing.step_issued(step)
            window_steps += 1
            log_steps += 1
            learning_rates.append([step, scheduler.get_last_lr()[0]])
            pending.append((step, figures))
            log_step = step % train.log_every == 0 or step == total_steps
            checkpoint_step = step % train.checkpoint_every == 0 and step < total_steps
            if not (device_skip and not log_step and not checkpoint_step and step > 1):
                blocked = time.perf_counter()
                read_back()
                now = time.perf_counter()
                timing.add_readback(now - blocked)
                timing.collect()  # the steps the device has finished; never waits
                timing.mark_allocator(step)
                elapsed, window_start = now - window_start, now
                # each step of the window since the last read-back: its mean time (no sync in between)
                step_seconds.extend([done, elapsed / window_steps] for done in range(step - window_steps + 1, step + 1))
                if step > 1:  # the first step carries warm-up cost; rates come from the rest
                    train_time, steps_timed = train_time + elapsed, steps_timed + window_steps
                if log_step:
                    # counted on the host: a collective (and its sync) only when there are other ranks to add
                    tokens = window_tokens if accelerator.num_processes == 1 else accelerator.reduce(
                        torch.tensor(window_tokens, device=accelerator.device), reduction="sum").item()
                    log_elapsed, log_start = now - log_start, now
                    if accelerator.is_main_process:
                        figures_out = {
                            "loss": last["loss"],
                            "learning_rate": scheduler.get_last_lr()[0],
                            "pairs_per_s": pairs_per_step * log_steps / log_elapsed,
                            "tokens_per_s": tokens / log_elapsed,
                            "peak_mem_gib": peak_memory_gib(accelerator.device),
                            "grad_norm": last["grad_norm"],
                        }
                        tracker.log_metrics({k: v for k, v in figures_out.items() if math.isfinite(v)}, step=step)
                        eta = (total_steps - step) * (now - started) / max(1, step)
                        log.info(
                            "step %d/%d loss %.4f lr %.2e pairs/s %.1f tokens/s %.0f ETA %ds",
                            step, total_steps, last["loss"], figures_out["learning_rate"], figures_out["pairs_per_s"],
                            figures_out["tokens_per_s"], int(eta),
                        )
                    window_tokens, log_steps = 0, 0
                window_steps = 0
            # Never inside a run of non-finite steps: the newest checkpoint stays the last finite one.
            if checkpoint_step and nonfinite_in_a_row == 0:
                state = {"step": step, "losses": losses, "learning_rates": learning_rates,
                         "skipped_steps": skipped_steps}
                save_checkpoint(accelerator, ckpt_root, step, state, train.keep_last)
            beat_started = time.perf_counter()
            beat(step, "step", total=total_steps)  # also the launcher's progress bar (training/progress.py)
            timing.add_heartbeat(time.perf_counter() - beat_started)
            fault_point(f"after_step_{step}")
            if step >= total_steps:
                break
        epoch += 1
    read_back()
    timing.close()
    timing.mark_allocator(step)
    # the same window as pairs_per_s: the steps after this process's first
    step_timing = timing.summary(first_step + 1, pairs_per_step=pairs_per_step) | {"per_step": timing.per_step()}

    beat(step, "finishing")
    # Replicas must agree after DDP steps; gather one fingerprint per rank and compare.
    fingerprints = accelerator.gather(replica_fingerprint(accelerator.unwrap_model(model)).unsqueeze(0))
    replica_diff = (fingerprints - fingerprints[0]).abs().max().item()
    peak = accelerator.gather(torch.tensor([peak_memory_gib(accelerator.device)], device=accelerator.device))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        adapter_dir = out_dir / "adapter"
        # Saved with the adapter: evaluation, the MLflow model and Reranker.from_pretrained score with these.
        trained_with = ProcessingConfig(max_length=train.max_length, min_pixels=train.min_pixels,
                                        max_pixels=max_pixels_at(1.0, collate.schedule, train.max_pixels))
        accelerator.unwrap_model(model).save_pretrained(adapter_dir, processing=trained_with)
        # sha256 of every adapter file: a re-run reuses this stage only while they still match.
        checkpoints.write_folder_manifest(adapter_dir, out_dir / ADAPTER_MANIFEST)
        wall = time.perf_counter() - started
        result = StageResult(
            stage=spec.stage,
            devices=accelerator.num_processes,
            device_type=accelerator.device.type,
            steps=step,
            train_pairs=step * pairs_per_step,
            full_train_pairs=len(records) * train.group_size,  # one epoch over the training split
            wall_time_s=wall,
            pairs_per_s=(steps_timed * pairs_per_step / train_time) if steps_timed else step * pairs_per_step / wall,
            peak_mem_gib=peak.tolist(),
            step_seconds=step_seconds,
            losses=losses,
            learning_rates=learning_rates,
            schedule=dataclasses.asdict(schedule),
            skipped_steps=skipped_steps,
            final_loss=losses[-1][1] if losses else float("nan"),
            replica_max_diff=replica_diff,
            truncation=truncation,
            processing=trained_with,
            negative_fill=collator.fill_stats.as_dict(),  # rank 0's groups (filled_slots: random negatives)
            dataloader=loader_kwargs,
            timing=step_timing,  # training.step_timing: data wait, host issue, device span/gaps per step
            activation_checkpointing=(dataclasses.asdict(checkpoint_choice) if checkpoint_choice is not None
                                      else spec.model.activation_checkpointing),
            adapter_dir=str(adapter_dir),
            adapter_manifest=str(out_dir / ADAPTER_MANIFEST),
            spec_hash=spec.spec_hash,
            mlflow_run_id=tracker.run_id,
            tracking_failures=tracker.failures,
            records_seen=traced if trace_records else None,
        )
        tracker.log_metrics({"final_loss": result.final_loss, "stage_pairs_per_s": result.pairs_per_s,
                             "replica_max_diff": replica_diff, "wall_time_s": wall})
        tracker.log_artifacts(str(adapter_dir), "adapter")
        tracker.end()
        result.write(out_dir / RESULT_FILE)
        log.info("stage %s done: %d steps, %.1f pairs/s, final loss %.4f", spec.stage, step, result.pairs_per_s,
                 result.final_loss)
        log.info("step time (steps %s-%s): %s", step_timing.get("first_step"), step_timing.get("last_step"),
                 ", ".join(f"{k} {v:.3g}" for k, v in step_timing.items() if isinstance(v, float)))
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
