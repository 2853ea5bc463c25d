"""The step log of a stage: what the loop reports about its optimizer steps, read back from the device as
rarely as it can.

Each step's [mean loss, gradient norm] stays on the device until a read-back (one host synchronisation for
all the steps pending): at a logging step, before a checkpoint, at the first and the last step, and every
step when the non-finite check is on the host. A read-back closes a window: the window's wall time gives
each of its steps a mean duration (``step_seconds``) and the stage's rate (``pairs_per_s``, the first step
left out), and a logging step also logs the rates and MLflow step metrics (through the stage's tracker, rank 0).
The non-finite steps read back are recorded as skipped; too many in a row stop the stage (``NonFiniteStop``).
"""

from __future__ import annotations

import logging
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

from lychee_pipeline.training import checkpoints
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.training.step import MicroBatch
from lychee_pipeline.training.step_timing import StepTiming

log = logging.getLogger("lychee_pipeline.training.train")  # the stage's log lines keep their logger


class NonFiniteStop(RuntimeError):
    """Too many non-finite optimizer steps in a row: the stage stops before it trains on garbage."""


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory (CUDA allocator) or peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepLog:
    """Per micro-batch ``count``, per optimizer step ``step_issued``, at the end ``close``; ``losses``,
    ``learning_rates`` and ``skipped_steps`` carry on from a resumed checkpoint's state."""

    def __init__(self, accelerator: Any, scheduler: Any, tracker: Any, train: TrainingParams, stage: str,
                 total_steps: int, pairs_per_step: int, checkpoint_root: Path, skip_on_device: bool,
                 truncation_keys: list[str], resumed: dict, first_step: int, trace_records: bool):
        self.accelerator, self.scheduler, self.tracker = accelerator, scheduler, tracker
        self.train, self.stage, self.total_steps, self.pairs_per_step = train, stage, total_steps, pairs_per_step
        self.checkpoint_root, self.skip_on_device = checkpoint_root, skip_on_device
        self.losses: list = resumed.get("losses", [])
        self.learning_rates: list = resumed.get("learning_rates", [])
        self.skipped_steps: list = resumed.get("skipped_steps", [])
        self.nonfinite_in_a_row = 0
        self.truncation = {k: 0 for k in truncation_keys}  # summed from the batches (collated in any process)
        self.traced: list | None = [] if trace_records else None
        self.last = {"loss": float("nan"), "grad_norm": float("nan")}
        # Steps whose loss and gradient norm are still on the device, read back together (one sync).
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.started = time.perf_counter()
        self.window_start, self.window_steps = self.started, 0  # since the last read-back (rates of the result)
        self.log_start, self.log_steps, self.window_tokens = self.started, 0, 0  # since the last logging step
        self.train_time, self.steps_timed = 0.0, 0
        self.step_seconds: list = []  # [step, seconds] of every optimizer step, for the scaling report's windows
        # Where each step's time goes (data wait, host issue, device span and gaps), read without per-step syncs.
        self.timing, self.first_step = StepTiming(accelerator.device), first_step

    def count(self, batch: MicroBatch, step: int) -> None:
        """A micro-batch of optimizer step ``step + 1``: its tokens and truncations (counted on the host)."""
        self.window_tokens += batch.tokens
        for key, count in batch.truncation.items():
            self.truncation[key] += int(count)
        if self.traced is not None:  # every micro-batch of every rank, under the optimizer step it belongs to
            self.traced.append([step + 1, self.accelerator.gather(batch.record_index.to(self.accelerator.device)).tolist()])

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint keeps besides Accelerate's state: the history a resumed run carries on."""
        return {"step": step, "losses": self.losses, "learning_rates": self.learning_rates,
                "skipped_steps": self.skipped_steps}

    def step_issued(self, step: int, figures: torch.Tensor, checkpoint_due: bool) -> None:
        """Optimizer step ``step`` handed to the device; read back and log when this step needs it."""
        self.timing.step_issued(step)
        self.window_steps += 1
        self.log_steps += 1
        self.learning_rates.append([step, self.scheduler.get_last_lr()[0]])
        self.pending.append((step, figures))
        log_step = step % self.train.log_every == 0 or step == self.total_steps
        if self.skip_on_device and not log_step and not checkpoint_due and step > 1:
            return
        blocked = time.perf_counter()
        self.read_back()
        now = time.perf_counter()
        self.timing.add_readback(now - blocked)
        self.timing.collect()  # the steps the device has finished; never waits
        self.timing.mark_allocator(step)
        elapsed, self.window_start = now - self.window_start, now
        # each step of the window since the last read-back: its mean time (no sync in between)
        self.step_seconds.extend([done, elapsed / self.window_steps]
                                 for done in range(step - self.window_steps + 1, step + 1))
        if step > 1:  # the first step carries warm-up cost; rates come from the rest
            self.train_time, self.steps_timed = self.train_time + elapsed, self.steps_timed + self.window_steps
        if log_step:
            self.log_rates(step, now)
        self.window_steps = 0

    def read_back(self) -> None:
        """Move the pending steps' figures to the host: losses, skipped steps, the non-finite stop."""
        if not self.pending:
            return
        values = torch.stack([v for _, v in self.pending]).tolist()  # the one host synchronisation
        for (done, _), (mean_loss, grad_norm) in zip(self.pending, values):
            self.last.update(loss=mean_loss, grad_norm=grad_norm)
            if math.isfinite(mean_loss) and math.isfinite(grad_norm):
                self.losses.append([done, mean_loss])
                self.nonfinite_in_a_row = 0
                continue
            self.skipped_steps.append([done, mean_loss, grad_norm])
            self.nonfinite_in_a_row += 1
            log.warning("step %d skipped: non-finite loss %s / gradient norm %s (%d in a row, %d in all)",
                        done, mean_loss, grad_norm, self.nonfinite_in_a_row, len(self.skipped_steps))
            self.tracker.log_metrics({"skipped_steps": len(self.skipped_steps)}, step=done)
            if self.nonfinite_in_a_row >= self.train.max_nonfinite_steps:
                self.stop_on_nonfinite(done)
        self.pending.clear()

    def stop_on_nonfinite(self, done: int) -> None:
        newest = checkpoints.list_checkpoints(self.checkpoint_root)
        message = (
            f"stage {self.stage}: {self.nonfinite_in_a_row} non-finite steps in a row (steps "
            f"{done - self.nonfinite_in_a_row + 1}-{done}); last finite checkpoint: "
            f"{newest[0] if newest else 'none'}; resume with training.resume=true and a lower "
            "training.learning_rate"
        )
        log.error("%s", message)
        raise NonFiniteStop(message)

    def log_rates(self, step: int, now: float) -> None:
        """A logging step: the rates since the last one, to MLflow and the log (rank 0)."""
        accelerator = self.accelerator
        # counted on the host: a collective (and its sync) only when there are other ranks to add
        tokens = self.window_tokens if accelerator.num_processes == 1 else accelerator.reduce(
            torch.tensor(self.window_tokens, device=accelerator.device), reduction="sum").item()
        log_elapsed, self.log_start = now - self.log_start, now
        if accelerator.is_main_process:
            figures = {
                "loss": self.last["loss"],
                "learning_rate": self.scheduler.get_last_lr()[0],
                "pairs_per_s": self.pairs_per_step * self.log_steps / log_elapsed,
                "tokens_per_s": tokens / log_elapsed,
                "peak_mem_gib": peak_memory_gib(accelerator.device),
                "grad_norm": self.last["grad_norm"],
            }
            self.tracker.log_metrics({k: v for k, v in figures.items() if math.isfinite(v)}, step=step)
            eta = (self.total_steps - step) * (now - self.started) / max(1, step)
            log.info("step %d/%d loss %.4f lr %.2e pairs/s %.1f tokens/s %.0f ETA %ds", step, self.total_steps,
                     self.last["loss"], figures["learning_rate"], figures["pairs_per_s"], figures["tokens_per_s"],
                     int(eta))
        self.window_tokens, self.log_steps = 0, 0

    def close(self, step: int) -> dict:
        """After the last step: the pending read-back, and the timing summary of the steps after the first."""
        self.read_back()
        self.timing.close()
        self.timing.mark_allocator(step)
        # the same window as pairs_per_s: the steps after this process's first
        return (self.timing.summary(self.first_step + 1, pairs_per_step=self.pairs_per_step)
                | {"per_step": self.timing.per_step()})

    def pairs_per_s(self, step: int, wall: float) -> float:
        """The stage's rate over the steps after the first (the whole run's when it had only one)."""
        if self.steps_timed:
            return self.steps_timed * self.pairs_per_step / self.train_time
        return step * self.pairs_per_step / wall
