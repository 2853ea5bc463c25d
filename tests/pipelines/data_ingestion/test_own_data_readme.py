"""The README's "Your own data" instructions, followed literally on data generated outside the project."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from lychee_pipeline.data.images import parse_image_roots
from lychee_pipeline.data.catalogue import ensure_demo_data

README = Path(__file__).resolve().parents[3] / "README.md"


def _readme_local_parameters() -> str:
    """The YAML block of the README's "Your own data" section, exactly as written there."""
    section = README.read_text(encoding="utf-8").split("## Your own data", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def _shop_outside_project(base: Path) -> dict:
    """Demo records and images laid out as the README's paths say: JSONL in one folder, images in two roots."""
    made = ensure_demo_data({"out_dir": str(base / "gen"), "seed": 5, "n_products": 40, "n_records": 200})
    jsonl_dir = base / "data/shop/jsonl"
    jsonl_dir.mkdir(parents=True)
    shutil.copy(made["files"][0], jsonl_dir / "records.jsonl")
    images = sorted((base / "gen/images").iterdir())
    for i, image in enumerate(images):  # half the images under each root: both roots are needed
        root = base / ("data/shop" if i % 2 else "mnt/img")
        (root / "images").mkdir(parents=True, exist_ok=True)
        shutil.copy(image, root / "images" / image.name)
    return {"records": made["records"]}


def _counts(root: Path) -> dict:
    return json.loads((root / "data/05_model_input/data_counts.json").read_text())


def test_readme_local_parameters_run_the_data_pipeline(tmp_path):
    from project_runs import make_project_copy, run_kedro

    shop = _shop_outside_project(tmp_path / "outside")
    text = _readme_local_parameters()
    assert "raw_path: /data/shop/jsonl" in text and "image_roots: [/data/shop, /mnt/img]" in text
    local = re.sub(r"(?<=[\s\[])/(data/shop|mnt/img)", lambda m: f"{tmp_path / 'outside'}/{m.group(1)}", text)
    root = make_project_copy(tmp_path / "project")
    (root / "conf/local").mkdir(exist_ok=True)
    (root / "conf/local/parameters.yml").write_text(local, encoding="utf-8")
    run_kedro(root, "data")
    counts = _counts(root)
    assert counts["lines_in"] == shop["records"] == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert counts["rejected"] == 0 and counts["quarantined"] == 0 and counts["images_bad"] == 0
    assert counts["train_size"] + counts["val_size"] + counts["test_size"] == counts["clean"] > 0
    source = json.loads((root / "data/02_intermediate/raw_source.json").read_text())
    assert source["demo"] is False and len(source["image_roots"]) == 2
    assert not (root / "data/01_raw/demo").exists()
    raw_files = json.loads((root / "data/02_intermediate/raw_files.json").read_text())
    assert raw_files["read"] == 1 and raw_files["files"][0]["lines"] == shop["records"]


def test_two_image_roots_on_the_command_line(tmp_path):
    from kedro.framework.cli.utils import _split_params
    from project_runs import make_project_copy, run_kedro

    shop = _shop_outside_project(tmp_path / "outside")
    base = tmp_path / "outside"
    cli = f"data.raw_path={base}/data/shop/jsonl,data.image_roots={base}/data/shop:{base}/mnt/img"
    params = _split_params(None, None, cli)  # exactly what `kedro run --params "<cli>"` passes on
    root = make_project_copy(tmp_path / "project")
    run_kedro(root, "data", params)
    counts = _counts(root)
    assert counts["clean"] == shop["records"] and counts["quarantined"] == 0 and counts["images_bad"] == 0


@pytest.mark.parametrize(("value", "expected"), [
    (None, []), ([], []), ("/a", ["/a"]), ("/a:/b", ["/a", "/b"]), (" /a : /b :", ["/a", "/b"]),
    (["/a", "/b"], ["/a", "/b"]),
])
def test_image_roots_accept_a_list_or_a_pathsep_string(value, expected):
    assert parse_image_roots(value) == expected
