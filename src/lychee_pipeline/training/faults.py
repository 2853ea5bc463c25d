"""Fault injection for the reliability tests, read from the environment of a stage's processes.

``LYCHEE_FAULT`` names the fault and ``LYCHEE_FAULT_RANK`` the rank it hits (default 0; ``nan_loss*`` hits
every rank). Unset, every hook here is a no-op: the loop calls them at the points a real fault would strike.
"""

from __future__ import annotations

import os
import time


def fault_point(name: str) -> None:
    """LYCHEE_FAULT=<name> kills this process (SIGKILL) here.

    Points: `after_step_<n>`, `during_checkpoint` (any checkpoint) / `during_checkpoint_<step>` (after
    save_state, before publish), `before_end_training`; LYCHEE_FAULT_RANK picks the rank (default 0).
    `hang_<name>` makes the rank go silent here, `exit_<name>` makes it leave with exit code 0.
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
    """LYCHEE_FAULT=nan_loss (every step), nan_loss_at_<k> or nan_loss_from_<k> (optimizer step k): the loss of
    that step's micro-batches is made NaN, so the non-finite skip and stop can be tested."""
    fault = os.environ.get("LYCHEE_FAULT", "")
    if fault == "nan_loss":
        return True
    if fault.startswith("nan_loss_at_"):
        return step == int(fault.rsplit("_", 1)[1])
    if fault.startswith("nan_loss_from_"):
        return step >= int(fault.rsplit("_", 1)[1])
    return False
