"""The benchmarks' new outputs, run on the CPU with the tiny architecture (the code paths the GPU runs take):
inference.py's pairs/s, tokens/s and MFU lines, its prefix-reuse variant (tokens saved, same scores) and its FP8
variant (torchao emulated on a CPU); train_step.py's MFU against both named peaks and its profile (a Chrome trace
and the top 15 non-matmul kernels)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def benchmarks():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import inference
        import train_step

        yield inference, train_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.slow
def test_inference_prints_rates_mfu_parity_prefix_reuse_and_fp8(benchmarks, tmp_path, capsys):
    """Without torchao (the gpu extra) the FP8 variant is left out and everything else is still checked."""
    import importlib.util

    fp8 = importlib.util.find_spec("torchao") is not None
    inference, _ = benchmarks
    args = ["--tiny", "--queries", "3", "--docs", "4", "--fast-check", "0", "--prefix-reuse",
            "--tiny-dir", str(tmp_path / "tiny"), "--out", str(tmp_path)]
    assert inference.main(args + (["--fp8", "--fp8-check", "8"] if fp8 else [])) == 0
    out = capsys.readouterr().out
    for name in ("naive", "core", "core-prefix", *(("core-fp8",) if fp8 else ())):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{name}:"))
        assert "pairs/s" in line and "tok/s" in line and "MFU" in line
    core_line = next(x for x in out.splitlines() if x.strip().startswith("core:"))
    assert "max |dlogit|" in core_line and "(median " in core_line  # parity against the naive loop
    prefix_line = next(x for x in out.splitlines() if x.startswith("prefix reuse:"))
    assert "saved" in prefix_line and "same ranking 3/3 queries" in prefix_line  # auto is off on a CPU: core-prefix on
    results = json.loads((tmp_path / "inference_tiny.json").read_text())["results"]
    parity = results["core"]["vs_naive"]
    assert 0 <= parity["median_abs_logit_diff"] <= parity["max_abs_logit_diff"]
    assert results["core-prefix"]["tokens_run"] < results["core"]["tokens_run"]
    assert results["core-prefix"]["vs_core"]["max_abs_logit_diff"] < 1e-4  # fp32: the same scores
    if fp8:
        assert "EMULATED on the CPU" in out and "fp8:" in out
        assert results["core-fp8"]["fp8_vs_fp32"]["max_abs_logit_diff"] > 0  # float8 rounding shows


@pytest.mark.slow
def test_train_step_prints_mfu_against_both_peaks_and_profiles(benchmarks, tmp_path, capsys):
    _, train_step = benchmarks
    trace = tmp_path / "step.json"
    assert train_step.main(["--tiny", "--variants", "c0+pack,c0+pack+fp8", "--groups", "2", "--warmup", "1", "--steps", "2",
                            "--vision-micro", "0", "--check-groups", "0", "--no-grad-check", "--no-score-check",
                            "--profile", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "MFU against the measured bf16 matmul rate" in out and "against the datasheet peak" in out
    assert "top 15 non-matmul device kernels:" in out
    table = out.split("top 15 non-matmul device kernels:")[1].splitlines()[2:17]
    assert table and not any("aten::mm" in row or "addmm" in row for row in table)
    assert json.loads(trace.read_text())["traceEvents"]
    if "c0+pack+fp8: skipped" in out:  # no torchao (the gpu extra): the +fp8 lever says why it did not run
        assert "needs torchao" in out
    else:  # torchao installed: the +fp8 lever ran, emulated on the CPU
        assert "(EMULATED on the CPU)" in out and "c0+pack+fp8" in out.split("summary (")[1]


def test_vision_tower_prints_each_step_with_its_parity(capsys, monkeypatch, tmp_path):
    """vision_tower.py --tiny (the CPU run of the GPU tool): a line per fast-path step, each with the features'
    largest difference from the stock forward's, then the profile by kind; its temporary folder is gone after."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vision_tower
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert vision_tower.main(["--tiny", "--pairs", "8", "--rows", "3"]) == 0
    assert not any(scratch.iterdir())  # the processor and the JPEGs it wrote were removed
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if "TFLOP/s =" in line]
    assert [line.split("  ")[0].strip() for line in steps] == [
        "stock transformers forward (SDPA per window / image)", "+ one attention call per window or image size",
        "+ patch embedding as a matmul"]
    assert all("features against the first line's: max |d|" in line for line in steps[1:])
    assert "one batch of" in out and "[attention]" in out


def test_a_benchmarks_scratch_folder_goes_when_timeout_stops_it(tmp_path):
    """``timeout`` ends a benchmark with SIGTERM: its temporary folder (a 7B model folder is ~16 GiB) is removed
    then too, and a folder the caller named stays."""
    code = ("import sys, time; sys.path.insert(0, 'benchmarks'); import common\n"
            "with common.scratch_folder('lychee_t_', sys.argv[1] or None) as f:\n"
            "    (f / 'weights').write_bytes(b'0' * 1024); print(f, flush=True); time.sleep(60)\n")
    for given in ("", str(tmp_path / "named")):
        env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
        proc = subprocess.Popen([sys.executable, "-c", code, given], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                text=True)
        try:
            folder = Path(proc.stdout.readline().strip())
            assert (folder / "weights").is_file()
            proc.send_signal(signal.SIGTERM)
            # the temporary folder's exit is a SystemExit (so cleanup runs); a named folder's, the default
            assert proc.wait(timeout=30) == (-signal.SIGTERM if given else 128 + signal.SIGTERM)
        finally:
            proc.kill()
            proc.wait()
        assert folder.exists() == bool(given)
