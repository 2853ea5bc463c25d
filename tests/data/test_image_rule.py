"""One image-path rule: what ingestion accepts, the served model accepts; what one refuses, the other refuses."""

from __future__ import annotations

import os
import unicodedata

import pandas as pd
import pytest
from PIL import Image

from lychee_pipeline.data.images import Resolver, parse_image_roots
from lychee_pipeline.mlflow_model import ImagePathError, image_roots_from, pairs_from_frame
from lychee_pipeline.pipelines.data_ingestion.nodes import locate_raw_data

NAME = "café.png"  # é: one code point in NFC, e + combining accent in NFD


@pytest.fixture()
def shop(tmp_path):
    """A raw-data folder whose image name is stored on disk in NFD (as macOS writes it)."""
    root = tmp_path / "shop"
    root.mkdir()
    Image.new("RGB", (8, 8), "red").save(root / unicodedata.normalize("NFD", NAME))
    (root / "records.jsonl").write_text("{}\n", encoding="utf-8")
    outside = tmp_path / "outside.png"
    Image.new("RGB", (8, 8), "blue").save(outside)
    (root / "link.png").symlink_to(outside)
    return root


def _served(ref: str, roots: list[str]) -> str:
    frame = pd.DataFrame([{"query_text": "red", "doc_image": ref}])
    return pairs_from_frame(frame, roots)[0][1]["image"]


def test_a_name_ingestion_accepts_in_the_other_normalization_form_is_accepted_by_the_served_model(shop):
    roots = locate_raw_data({"raw_path": str(shop)}, {})["image_roots"]  # what ingestion and training use
    ref = unicodedata.normalize("NFC", NAME)
    assert not os.path.exists(shop / ref)  # only the NFD name is on disk (a filesystem that keeps names as given)
    ingested, reason = Resolver(roots).resolve(ref)
    assert reason is None and ingested == str(shop / unicodedata.normalize("NFD", NAME))
    assert _served(ref, roots) == ingested


@pytest.mark.parametrize("ref", ["../outside.png", "link.png", "/etc/hostname"])
def test_a_path_outside_the_roots_is_refused_by_ingestion_and_by_the_served_model(shop, ref):
    roots = locate_raw_data({"raw_path": str(shop)}, {})["image_roots"]
    assert Resolver(roots).resolve(ref) == (None, f"path escapes the image roots: {ref}")
    with pytest.raises(ImagePathError, match="row 0: image path outside the allowed image roots"):
        _served(ref, roots)


def test_a_folder_is_not_an_image_for_either(shop):
    (shop / "sub").mkdir()
    roots = [str(shop)]
    # issue 32 item 9: its own reason (it was "image not found", and "corrupt image" before that)
    assert Resolver(roots).resolve("sub") == (None, "a folder, not an image file: sub")
    with pytest.raises(ImagePathError, match="a folder, not an image file: sub"):
        _served("sub", roots)


def test_the_roots_are_parsed_by_one_rule_everywhere(tmp_path):
    joined = os.pathsep.join([str(tmp_path / "a"), " ", str(tmp_path / "b")])
    expected = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert parse_image_roots(joined) == expected  # --params "data.image_roots=a:b"
    assert image_roots_from({}, {"LYCHEE_IMAGE_ROOTS": joined}) == expected  # where the model is served
    assert image_roots_from({"image_roots": [*expected, ""]}, {}) == expected  # the model's logged roots
    with pytest.raises(ImagePathError, match="no image roots are configured"):
        _served("x.png", image_roots_from({}, {}))
