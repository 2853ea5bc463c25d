"""Sharded strategies (issue 14 part 3): on this machine's CPUs they are refused before launch, in one line.

What was measured: with `training.launch.strategy: fsdp2` on 2 CPU processes, Accelerate 1.16 makes the ranks
plain gloo DDP (`DistributedType.MULTI_CPU`, checkpoints as one full `model.safetensors`), i.e. the FSDP template
is ignored without a word; the launcher now says so instead. DeepSpeed is not installed (and its ZeRO needs CUDA).
The test below also proves Accelerate still ignores FSDP on CPU: if a future Accelerate shards on CPU, it fails,
and the refusal should be lifted.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from reliability_helpers import stage_plan

from lychee_pipeline.runtime.launcher import free_port


@pytest.mark.parametrize("strategy, words", [
    ("fsdp2", "fsdp2 runs on CUDA GPUs only"),
    ("zero2", "zero2 needs DeepSpeed, which is not installed (pip install deepspeed"),
    ("zero3", "zero3 needs DeepSpeed, which is not installed (pip install deepspeed"),
])
def test_a_sharded_strategy_that_cannot_run_on_cpu_is_refused_in_one_line(tmp_path, strategy, words):
    if strategy != "fsdp2" and importlib.util.find_spec("deepspeed") is not None:
        words = f"{strategy} (DeepSpeed ZeRO) runs on CUDA GPUs only here"
    with pytest.raises(ValueError) as refused:
        stage_plan(tmp_path, gpus=2, launch={"strategy": strategy})
    message = str(refused.value)
    assert "\n" not in message and message.startswith("invalid parameter training.launch.strategy: ")
    assert words in message, message


def test_accelerate_still_ignores_fsdp_on_cpu(tmp_path):
    """The reason for the fsdp2 refusal, checked on the installed Accelerate with 2 real gloo processes."""
    script = tmp_path / "state.py"
    # each process writes its own file: two processes printing to one pipe interleaved their lines on a loaded machine
    script.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from accelerate import Accelerator
        a = Accelerator()
        Path({str(tmp_path)!r}, f"type_{{a.process_index}}.txt").write_text(str(a.distributed_type))
    """))
    config = tmp_path / "fsdp.yaml"
    config.write_text(textwrap.dedent(f"""
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        fsdp_config: {{fsdp_version: 2, fsdp_auto_wrap_policy: NO_WRAP, fsdp_state_dict_type: SHARDED_STATE_DICT}}
        num_machines: 1
        num_processes: 2
        machine_rank: 0
        main_process_port: {free_port()}
        mixed_precision: 'no'
        rdzv_backend: static
        same_network: true
        use_cpu: false
    """))
    env = dict(os.environ, ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                          str(script)], env=env, capture_output=True, text=True, timeout=120)
    types = sorted(path.read_text() for path in tmp_path.glob("type_*.txt"))
    assert types == ["DistributedType.MULTI_CPU"] * 2, out.stdout + out.stderr[-2000:]
