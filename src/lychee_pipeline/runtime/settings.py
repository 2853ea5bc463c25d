"""How a job is launched (`training.launch` in the parameters): processes, machines, limits, the watchdog."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class LaunchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: Literal["ddp", "zero2", "zero3", "fsdp2"] = "ddp"
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    num_machines: PositiveInt = 1
    machine_rank: int = Field(0, ge=0)
    main_process_ip: str | None = None
    main_process_port: int | None = Field(None, ge=1024, le=65535)
    timeout_s: PositiveInt = 6 * 3600  # wall-clock limit of one stage's launcher
    process_group_timeout_s: PositiveInt = 600  # a rank waiting longer on a collective fails
    # The launcher's watchdog (per-rank heartbeat files, see runtime/heartbeat.py):
    watchdog_s: PositiveInt = 1800  # a rank with no progress (no step, no phase change) this long stops the stage
    hang_after_exit_s: PositiveInt = 120  # after one rank exited, another silent this long is named as hung
    rendezvous_timeout_s: PositiveInt = 900  # startup limit: past the rendezvous (else the missing machines named) and to step 1
    threads_per_process: PositiveInt = 1  # CPU runs only
