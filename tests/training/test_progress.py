"""The launcher's progress display, fed by the ranks' heartbeats (runtime/progress.py), on real 2-process stages:

- under a pseudo-terminal, one rich bar for the stage that reaches 100% (and no relayed line per step);
- without a terminal, a few plain lines naming the stage (not one per step), the last at 100%, while the
  stage's own launch.log keeps every step's loss line.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from lychee_pipeline.runtime.heartbeat import Heartbeat, read_heartbeats
from lychee_pipeline.runtime.progress import summarize

COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # inside a line
CURSOR = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")  # a redraw: a new line of the screen

# One real stage, launched as the training pipeline launches it, with the log set up as Kedro sets it up: rich on
# a terminal, plain lines on stderr otherwise (hooks.plain_console_log_when_not_a_terminal).
DRIVER = """
import logging, sys
from lychee_pipeline.training.planning import plan_training, run_training_stage
table, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if sys.stderr.isatty():
    from rich.logging import RichHandler
    handler = RichHandler()
else:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
logging.basicConfig(level=logging.INFO, handlers=[handler])
training = dict(group_size=4, learning_rate=1e-3, warmup_ratio=0.0, scheduler="constant", max_steps=steps,
                max_length=512, max_pixels=12544, checkpoint_every=1000, keep_last=1, seed=1)
plan = plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 8}}, training, {"check_steps": {1: 6, 2: 6}},
                     2, "cpu", {"name": "t", "output_root": out})
result = run_training_stage(table, plan, devices=2, final=True)
print("RESULT steps", result.steps, flush=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LYCHEE_PROGRESS", "LYCHEE_PROGRESS_EVERY_PERCENT",
                                                            "LYCHEE_PROGRESS_EVERY_S", "NO_COLOR", "TTY_COMPATIBLE",
                                                            "TTY_INTERACTIVE", "FORCE_COLOR", "COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    return env


def test_a_terminal_shows_one_bar_per_stage_that_reaches_100_percent(tmp_path, training_table_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 200 columns: the bar fits
    process = subprocess.Popen([sys.executable, "-c", DRIVER, training_table_path, str(tmp_path), "8"],
                               stdin=follower, stdout=follower, stderr=follower, env=_env(), close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the follower side closed: the process is gone
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        os.close(leader)
    screen = CURSOR.sub("\n", COLOUR.sub("", b"".join(chunks).decode("utf-8", "replace")))
    assert process.returncode == 0, screen[-3000:]
    assert "RESULT steps 8" in screen
    bars = [line for line in screen.splitlines() if line.strip().startswith("stage_2cpu_final") and "/8" in line]
    assert bars, screen[-3000:]
    assert any("8/8 steps" in line and "100%" in line for line in bars), bars[-5:]
    # the bar stands for the ranks' per-step lines: none of them reaches the terminal
    assert not re.search(r"\] step \d+/8 loss", screen), screen[-3000:]


def test_without_a_terminal_a_few_plain_lines_name_the_stage(tmp_path, training_table_path):
    steps = 30
    done = subprocess.run([sys.executable, "-c", DRIVER, training_table_path, str(tmp_path), str(steps)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    progress = [line for line in lines if "lychee_pipeline.runtime.progress" in line]
    # at most one per tenth of the stage (or 30 s) and the last one: a few lines, never one per step
    assert 1 <= len(progress) <= 12, progress
    assert all("stage_2cpu_final: step " in line for line in progress), progress
    assert f"step {steps}/{steps} (100%)" in progress[-1] and "loss " in progress[-1], progress[-1]
    assert not [line for line in lines if re.search(rf"\] step \d+/{steps} loss", line)], "per-step lines relayed"
    # the losses stay in the stage's own log
    launch_log = next(Path(tmp_path).rglob("stage_2cpu_final/launch.log")).read_text()
    assert len(re.findall(rf"\[rank 0\] step \d+/{steps} loss", launch_log)) == steps


def test_scoring_shards_add_up_and_training_ranks_wait_for_the_slowest(tmp_path):
    """What the display reads from real heartbeat files: sharded ranks are summed, data-parallel ranks give
    the slowest rank's step; a rank's record after its work (step 0, `leaving`) keeps its task and total."""
    scoring = tmp_path / "scoring"
    first, second = Heartbeat(scoring, 0, unit="pair", sharded=True), Heartbeat(scoring, 1, unit="pair", sharded=True)
    first(0, "started")
    assert summarize(read_heartbeats(scoring)) == {}  # no total yet: nothing to show
    first(0, "step", total=10, task="base")
    second(0, "step", total=10, task="base")
    first(5, "step")
    second(3, "step")
    assert summarize(read_heartbeats(scoring)) == {"base": (8, 10, "pair")}
    first(0, "leaving")
    assert read_heartbeats(scoring)[0]["task"] == "base" and read_heartbeats(scoring)[0]["total"] == 10

    training = tmp_path / "training"
    rank0, rank1 = Heartbeat(training, 0), Heartbeat(training, 1)
    rank0(7, "step", total=20)
    rank1(6, "step", total=20)
    assert summarize(read_heartbeats(training)) == {None: (6, 20, "step")}


def test_a_scoring_launch_shows_each_model_to_the_end(tmp_path, caplog):
    """The last slices of a model may come and go between two looks: a model that the next one followed, and
    every model once the ranks are past the final barrier, is shown complete (real heartbeat files)."""
    import logging

    from lychee_pipeline.runtime.progress import StageProgress

    caplog.set_level(logging.INFO, logger="lychee_pipeline.runtime.progress")
    shown = StageProgress("scoring", terminal=False)
    ranks = [Heartbeat(tmp_path, rank, unit="pair", sharded=True) for rank in (0, 1)]
    for rank in ranks:
        rank(0, "step", total=21, task="base")
    ranks[0](5, "step")
    shown.update(read_heartbeats(tmp_path))
    ranks[0](0, "step", total=21, task="stage_1cpu_final")  # rank 0 is on the next model, rank 1 not yet seen
    shown.update(read_heartbeats(tmp_path))
    for rank in ranks:
        rank(0, "leaving")
    shown.update(read_heartbeats(tmp_path))
    shown.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "lychee_pipeline.runtime.progress"]
    assert "scoring base: 21/21 pairs (100%)" in "\n".join(lines), lines
    assert "scoring stage_1cpu_final: 21/21 pairs (100%)" in lines[-1], lines
    assert len(lines) <= 5, lines


def test_counted_work_in_a_file_is_a_few_plain_lines(caplog, capsys):
    """The image check and mining count their own work: in a log file (not a terminal) they write plain lines
    like a stage's, never a bar redrawn with carriage returns and cursor codes."""
    import logging

    from lychee_pipeline.runtime.progress import CountedProgress

    with caplog.at_level(logging.INFO, logger="lychee_pipeline.runtime.progress"):
        progress = CountedProgress("checking images", 500, "image")
        for _ in range(500):
            progress.update()
        progress.close()
        CountedProgress("mining negatives", 10, "record", enabled=False).update(10)  # progress off: nothing
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 11 and lines[-1].startswith("checking images: 500/500 images (100%)")
    assert not any("mining" in line for line in lines)
    printed = capsys.readouterr()
    assert "\r" not in printed.err + printed.out and "\x1b[" not in printed.err + printed.out


def test_counted_work_that_arrives_in_one_chunk_is_timed_from_its_start(caplog):
    """Issue 32 item 9: results handed back in chunks (the image check's process pool) arrive all at once; the
    rate counted from the first one seen read "688361.5 images/s". It counts from the moment the work began."""
    import logging
    import re
    import time

    from lychee_pipeline.runtime.progress import CountedProgress

    with caplog.at_level(logging.INFO, logger="lychee_pipeline.runtime.progress"):
        with CountedProgress("checking images", 100, "image") as progress:
            time.sleep(0.5)  # the pool starts and checks a chunk
            for _ in range(100):
                progress.update()
    line = [r.getMessage() for r in caplog.records][-1]
    rate = float(re.search(r"([\d.]+) images/s", line).group(1))
    assert 100 / 5 < rate <= 100 / 0.5, line
