"""What `kedro run` shows while it works: the image-check progress bar and the rich log handler."""

from __future__ import annotations


def test_data_run_shows_image_progress_and_logs(data_project):
    out = data_project["stdout"] + data_project["stderr"]
    # output to a pipe, as in a log file: the image check's progress is a few plain lines reaching the end,
    # never a bar redrawn with carriage returns or cursor codes
    assert "checking images: 1/80 images" in out and "checking images: 80/80 images (100%)" in out, out[-3000:]
    assert "\r" not in out and "\x1b[A" not in out
    assert "Pipeline execution completed successfully" in out
    assert (data_project["path"] / "info.log").is_file()               # conf/logging.yml's file handler
