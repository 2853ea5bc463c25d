"""Launch one training stage as real `accelerate launch` processes and collect its result.

Stage spec -> generated Accelerate config -> subprocess (its output streamed to our log and to
`<stage>/launch.log`) -> `<stage>/result.json`. A failed or hung child raises `StageFailed` naming the
log files and quoting each rank's last lines.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

RANK_PREFIX = re.compile(r"^\[default(\d+)\]:|^\[rank (\d+)\]")  # torchrun's --tee prefix, or our log format
# Library warnings would push a rank's real last words out of the few lines a failure quotes.
NOISE = re.compile(r"(Warning: |^\s*warnings\.warn\()")


class StageFailed(RuntimeError):
    """A stage's processes failed; the message says where the logs are."""


def free_port() -> int:
    """A free TCP port on loopback for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is visible, else cpu."""
    if device not in {"auto", "cuda", "cpu"}:
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device_count(devices: int, device_type: str) -> None:
    """Refuse more GPUs than are visible, before anything launches."""
    if device_type != "cuda":
        return
    import torch

    visible = torch.cuda.device_count()
    if devices > visible:
        raise ValueError(f"gpus={devices} asks for more GPUs than the {visible} visible on this machine")


def accelerate_config(
    devices: int, device_type: str, launch: dict[str, Any], template: dict[str, Any] | None
) -> dict[str, Any]:
    """The Accelerate config for a stage: DDP by default, or a DeepSpeed / FSDP template from conf/."""
    mixed = launch["mixed_precision"]
    if mixed == "auto":
        mixed = "bf16" if device_type == "cuda" else "no"
    config: dict[str, Any] = dict(template or {})
    multi = devices * launch["num_machines"] > 1
    if not template:
        config["distributed_type"] = "MULTI_GPU" if multi else "NO"
    config.update(
        compute_environment="LOCAL_MACHINE",
        num_processes=devices * launch["num_machines"],
        num_machines=launch["num_machines"],
        machine_rank=launch["machine_rank"],
        main_process_port=launch["main_process_port"] or free_port(),
        mixed_precision=mixed,
        dynamo_config={"dynamo_backend": "NO"},
        use_cpu=device_type == "cpu" and not multi,
        rdzv_backend="static",
        same_network=True,
    )
    if launch.get("main_process_ip"):
        config["main_process_ip"] = launch["main_process_ip"]
    return config


def child_environment(device_type: str, launch: dict[str, Any], tracking: dict[str, str]) -> dict[str, str]:
    """The children's environment: telemetry off, threads pinned on CPU, MLflow run ids passed down."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        KEDRO_DISABLE_TELEMETRY="1",
        MLFLOW_DISABLE_TELEMETRY="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if device_type == "cpu":
        threads = str(launch["threads_per_process"])
        # Accelerate only uses gloo on a machine without CUDA when told to use the CPU.
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   CUDA_VISIBLE_DEVICES="")
    env.update(tracking)
    return env


def run_stage(
    stage_dir: Path,
    spec: dict[str, Any],
    devices: int,
    device_type: str,
    template: dict[str, Any] | None = None,
    tracking_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one stage to completion and return its result.json, or raise StageFailed."""
    launch = spec["training"]["launch"]
    stage_dir.mkdir(parents=True, exist_ok=True)
    spec_path = stage_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    config = accelerate_config(devices, device_type, launch, template)
    config_path = stage_dir / "accelerate.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    (stage_dir / "result.json").unlink(missing_ok=True)
    rank_logs = stage_dir / "rank_logs"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path)]
    if config["num_processes"] > 1:
        command += ["--log_dir", str(rank_logs), "--tee", "3", "--monitor_interval", "1"]
    command += ["-m", "lychee_pipeline.training.train", "--spec", str(spec_path)]
    env = child_environment(device_type, launch, tracking_env or {})
    log_path = stage_dir / "launch.log"
    log.info("stage %s: %d %s process(es): %s", spec["stage"], config["num_processes"],
             "GPU" if device_type == "cuda" else "CPU", " ".join(command))

    last_lines: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=8))
    with open(log_path, "w", encoding="utf-8") as log_file:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
            start_new_session=True,  # so a timeout can stop the launcher and every rank together
        )

        def pump() -> None:
            for line in process.stdout:  # type: ignore[union-attr]
                log_file.write(line)
                log_file.flush()
                line = line.rstrip()
                match = RANK_PREFIX.match(line)
                rank = next((g for g in match.groups() if g is not None), None) if match else None
                if not NOISE.search(line[match.end():] if match else line):
                    last_lines[f"rank {rank}" if rank is not None else "launcher"].append(line)
                if line:
                    log.info("%s", line, extra={"markup": False})  # child output is not rich markup

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = time.monotonic() + launch["timeout_s"]
        timed_out = False
        while process.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
        process.wait()
        reader.join(timeout=10)

    result_path = stage_dir / "result.json"
    if timed_out or process.returncode != 0 or not result_path.is_file():
        why = f"timed out after {launch['timeout_s']} s" if timed_out else f"exited with code {process.returncode}"
        if config["num_processes"] > 1:  # name every rank, also one that died before it said anything
            for rank in range(config["num_processes"]):
                last_lines.setdefault(f"rank {rank}", collections.deque(["(no output)"]))
        tails = "\n".join(
            f"  {who}:\n" + "\n".join(f"    {line}" for line in lines) for who, lines in sorted(last_lines.items())
        )
        raise StageFailed(
            f"training stage {spec['stage']!r} {why}. Full log: {log_path}"
            + (f"; per-rank logs: {rank_logs}" if rank_logs.exists() else "")
            + f"\nLast lines:\n{tails}"
        )
    return json.loads(result_path.read_text())
