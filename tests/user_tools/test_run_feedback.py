"""What `kedro run` shows while it works: the image-check progress bar and the rich log handler."""

from __future__ import annotations


def test_data_run_shows_image_progress_and_logs(data_project):
    out = data_project["stdout"] + data_project["stderr"]
    assert "checking images" in out and "img" in out, out[-3000:]      # tqdm bar of check_unique_images
    assert "100%" in out                                                # it reaches the end
    assert "Pipeline execution completed successfully" in out
    assert (data_project["path"] / "info.log").is_file()               # conf/logging.yml's file handler
