"""Bad images (through the image check and the reranker's collator) and bad parameters (before any launch)."""

from __future__ import annotations

import resource
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image
from reliability_helpers import make_table, stage_plan

# imported first on purpose: the image check must not switch off PIL's bomb guard for the whole process
from lychee_pipeline.data.images import check_image
from lychee_pipeline.pipelines.training import nodes
from lychee_pipeline.training import planning
from lychee_pipeline.reranker.collate import BrokenImageError, PairCollator, load_image
from lychee_pipeline.runtime.errors import InvalidParameter

MIN_PIXELS, MAX_PIXELS = 3136, 12544


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_claiming(path: Path, width: int, height: int) -> Path:
    """A valid PNG header that claims width x height pixels, with a few bytes of image data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                     + _chunk(b"IEND", b""))
    return path


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from lychee_pipeline.reranker.families.qwen2_5_vl import load_processor
    from lychee_pipeline.reranker.tiny import ensure_tiny

    return load_processor(str(ensure_tiny(tmp_path_factory.mktemp("tiny") / "builtin_tiny")))


@pytest.fixture(scope="module")
def bad_images(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_images")
    paths = {"bomb": png_claiming(root / "bomb.png", 100_000, 100_000),  # 10^10 pixels, 30 GB decoded
             "big": png_claiming(root / "big.png", 12_000, 12_000)}  # 144 M: between PIL's warning and error
    noise = Image.effect_noise((64, 64), 64).convert("RGB")
    noise.save(root / "whole.png")
    data = (root / "whole.png").read_bytes()
    (root / "truncated.png").write_bytes(data[: len(data) // 2])
    paths["truncated"] = root / "truncated.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    sideways = Image.new("RGB", (40, 20), (200, 20, 20))  # stored: red left half, blue right half
    sideways.paste((20, 20, 200), (20, 0, 40, 20))
    sideways.save(root / "exif.jpg", exif=exif.tobytes(), quality=95)
    paths["exif"] = root / "exif.jpg"
    for name, size in {"tall": (1, 10_000), "wide": (10_000, 1), "pixel": (1, 1)}.items():
        Image.new("RGB", size, (20, 200, 20)).save(root / f"{name}.png")
        paths[name] = root / f"{name}.png"
    return paths


def _pair(image: Path):
    return ({"text": "green dress", "image": None}, {"text": "a dress", "image": str(image)})


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_decompression_bombs_refused_from_the_header_with_bounded_memory(bad_images, processor):
    before = _peak_rss_mib()
    bomb = check_image(str(bad_images["bomb"]), 50_000_000)
    assert not bomb["ok"] and bomb["reason"].startswith("too many pixels")
    big = check_image(str(bad_images["big"]), 50_000_000)
    assert big == {**big, "ok": False, "reason": "too many pixels: 12000x12000 > 50000000", "width": 12000}
    # the collator (training / inference) refuses the bomb too: PIL's guard is still on in this process
    with pytest.raises(BrokenImageError, match="bomb.png.*DecompressionBombError"):
        PairCollator(processor, max_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(
            [_pair(bad_images["bomb"])])
    assert _peak_rss_mib() - before < 300  # nothing was decoded


def test_truncated_image(bad_images, processor):
    row = check_image(str(bad_images["truncated"]), 10**6)
    assert not row["ok"] and row["reason"].startswith("corrupt image:")
    with pytest.raises(BrokenImageError, match="truncated.png"):
        PairCollator(processor, max_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(
            [_pair(bad_images["truncated"])])


def test_exif_rotated_jpeg_is_turned_upright(bad_images, processor):
    """The check records the stored 40x20 and the orientation tag; the loader (training and scoring alike)
    turns the pixels as a photo viewer does, so the model sees 20x40 portrait, the red pixels unchanged."""
    row = check_image(str(bad_images["exif"]), 10**6)
    assert row["ok"] and (row["width"], row["height"], row["orientation"]) == (40, 20, 6)
    assert check_image(str(bad_images["pixel"]), 10**6)["orientation"] == 1  # no EXIF at all
    upright = load_image(str(bad_images["exif"]))
    assert upright.size == (20, 40) and upright.mode == "RGB"
    # turned 90 degrees clockwise: the stored left (red) is now the top, the right (blue) the bottom
    red, blue = upright.getpixel((10, 5)), upright.getpixel((10, 35))
    assert red[0] > 150 > red[2] and blue[2] > 150 > blue[0], (red, blue)
    batch = PairCollator(processor, max_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(
        [_pair(bad_images["exif"])])
    _, grid_h, grid_w = batch["image_grid_thw"][0].tolist()
    assert grid_h > grid_w  # portrait, as displayed


@pytest.mark.parametrize("name", ["tall", "wide"])
def test_extreme_aspect_ratio_rejected_clearly(bad_images, processor, name):
    row = check_image(str(bad_images[name]), 10**6)
    assert not row["ok"] and row["reason"].startswith("aspect ratio too extreme: ")  # quarantined before training
    # handed to the collator anyway, it stops before the model, naming the limit
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        PairCollator(processor, max_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)([_pair(bad_images[name])])


def test_one_pixel_image_is_resized_up_to_min_pixels(bad_images, processor):
    assert check_image(str(bad_images["pixel"]), 10**6)["ok"]
    batch = PairCollator(processor, max_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(
        [_pair(bad_images["pixel"])])
    t, h, w = batch["image_grid_thw"][0].tolist()
    assert MIN_PIXELS <= h * w * 14 * 14 <= MAX_PIXELS


# ---- parameters: one line naming the dotted parameter, before anything launches ----------------------------

BAD_PARAMETERS = [
    ({}, {"group_size": "eight"}, "training.group_size: Input should be a valid integer"),
    ({}, {"learning_rate": -1e-4}, "training.learning_rate: Input should be greater than 0"),
    ({}, {"loss": "hinge"}, "training.loss: Input should be 'pointwise' or 'listwise'"),
    ({}, {"launch": {"timeout_s": 0}}, "training.launch.timeout_s: Input should be greater than 0"),
    ({}, {"lerning_rate": 1e-4}, "training.lerning_rate: Extra inputs are not permitted"),
    ({"name_or_path": "/no/such/model"}, {}, "model.name_or_path: no such folder '/no/such/model'"),
    ({"name_or_path": "./models/missing"}, {}, "model.name_or_path: no such folder"),
    ({"name_or_path": "builtin:huge"}, {}, "model.name_or_path: unknown built-in model"),
    ({"finetune": "lorax"}, {}, "model.finetune: Input should be"),
    ({"trust_remote_code": True}, {}, "model.trust_remote_code: remote code is never run"),
]


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was launched")

    monkeypatch.setattr(planning, "run_stage", refuse)


@pytest.mark.parametrize("model,training,message", BAD_PARAMETERS)
def test_bad_parameter_is_one_line_naming_it(tmp_path, no_launch, model, training, message):
    with pytest.raises(ValueError) as error:
        nodes.plan_training({"lora": {"r": 4}, **model}, training, {}, 1, "cpu",
                            {"name": "r", "output_root": str(tmp_path)})
    text = str(error.value)
    assert "\n" not in text and text.startswith("invalid parameter ") and message in text, text


def test_group_size_larger_than_the_negatives_fails_at_export_under_refuse(tmp_path, no_launch):
    table = make_table(tmp_path, negatives=5)  # 5 negatives each: group_size 6 fits, 7 does not
    assert nodes.export_training_table(table, stage_plan(tmp_path / "ok", group_size=6, negative_fill="refuse"))
    with pytest.raises(ValueError) as error:
        nodes.export_training_table(table, stage_plan(tmp_path / "bad", group_size=7, negative_fill="refuse"))
    text = str(error.value)
    assert "\n" not in text and text.startswith("invalid parameters training.group_size=7 with "
                                                "training.negative_fill=refuse: 9 of 9 training records")
    assert "data_processing.normalization.min_negatives to at least 6" in text
    assert not (tmp_path / "bad" / "r" / "train.parquet").exists()


def test_short_groups_are_filled_by_default_and_the_slots_logged(tmp_path, no_launch, caplog):
    table = make_table(tmp_path, negatives=5)
    with caplog.at_level("INFO", logger="lychee_pipeline.training.planning"):
        assert Path(nodes.export_training_table(table, stage_plan(tmp_path / "fill", group_size=8))).is_file()
    assert "9 of 9 training records have fewer than 7 negatives (fewest: 5); 18 group slot(s) per epoch" in caplog.text
    assert planning.short_group_counts(table, 8) == {"records": 9, "short_records": 9, "fewest_negatives": 5,
                                                   "filled_slots_per_epoch": 18}
    # 9 records hold 9 distinct documents: a record has 5 negatives and may draw the 3 others that are not its
    # own positive or negatives, so a group of 10 (9 negatives) cannot be filled, and 9 is the most that fits
    with pytest.raises(InvalidParameter) as error:
        nodes.export_training_table(table, stage_plan(tmp_path / "small", group_size=10))
    assert str(error.value).startswith("invalid parameter training.group_size=10: 9 of 9 training records cannot "
                                       "fill a group with 9 negatives (group_size - 1)"), error.value
    assert ("e.g. record red-dress: 5 own + 3 to draw; training.group_size is at most 9 for this data"
            in str(error.value))


@pytest.mark.parametrize("ids", ["by content", "one per mention"])
def test_the_check_before_launch_and_the_negative_draw_agree(tmp_path, no_launch, ids):
    """What export_training_table lets through, the draw fills for every record and epoch; what it refuses, the
    draw cannot fill (issue 32 item 6). "one per mention": every document has its own doc_id while the texts
    repeat (the draw compares by content too), which the old count of distinct doc_ids let through."""
    from lychee_pipeline.reranker.collate import ShortGroupError, sample_group

    table = make_table(tmp_path, negatives=5)
    if ids == "one per mention":
        rows = table.to_pylist()
        for row in rows:
            for n, doc in enumerate(row["positives"] + row["negatives"]):
                doc["doc_id"] = f"{row['record_id']}#{n}"
        table = pa.Table.from_pylist(rows, schema=table.schema)
    largest = planning.unfillable_groups(table, 2)["largest_group_size"]
    assert largest == (9 if ids == "by content" else 15)
    rows = table.to_pylist()
    assert nodes.export_training_table(table, stage_plan(tmp_path / "fits", group_size=largest))
    for epoch in range(3):
        for row in rows:
            group = sample_group(row, largest, epoch=epoch, seed=1, fill_pool=rows)
            assert len({(d["text"], d["image"]) for d in group["docs"]}) == largest
    with pytest.raises(InvalidParameter, match=f"training.group_size is at most {largest} for this data"):
        nodes.export_training_table(table, stage_plan(tmp_path / "too_big", group_size=largest + 1))
    short = dict((r, n) for r, *n in planning.unfillable_groups(table, largest + 1)["short"])
    for row in rows:
        if row["record_id"] in short:
            with pytest.raises(ShortGroupError):
                sample_group(row, largest + 1, fill_pool=rows)
        else:
            assert sample_group(row, largest + 1, fill_pool=rows)["docs"]
    doc_ids = {d["doc_id"] for row in rows for d in row["positives"] + row["negatives"]}
    if ids == "one per mention":  # the old count (distinct doc_ids >= group_size) let the larger group through
        assert len(doc_ids) >= largest + 1


def test_the_draw_finds_a_rare_usable_document_in_a_large_pool():
    """One usable document among 2000 records that repeat the record's own positive: the random picks run out
    of tries (320 for one slot), then every candidate is looked at, so the count before launch holds."""
    from lychee_pipeline.reranker.collate import drawable_negative_counts, sample_group

    same = {"doc_id": "same", "text": "a red dress", "image": None}
    rows = [{"record_id": "r", "query": {"text": "red dress"}, "positives": [same], "negatives": []}]
    rows += [{"record_id": f"o{i}", "query": {"text": f"q{i}"}, "positives": [same], "negatives": []}
             for i in range(2000)]
    rows.append({"record_id": "rare", "query": {"text": "hat"}, "positives": [
        {"doc_id": "hat", "text": "a blue hat", "image": None}], "negatives": []})
    assert drawable_negative_counts(rows)[0] == 1
    group = sample_group(rows[0], 2, seed=0, fill_pool=rows)
    assert group["doc_ids"] == ["same", "hat"] and group["filled"] == 1


def test_negative_fill_is_a_checked_parameter(tmp_path):
    with pytest.raises(ValueError, match="invalid parameter training.negative_fill: Input should be 'fill_random' "
                                         "or 'refuse'"):
        stage_plan(tmp_path, negative_fill="random")


def test_a_hub_id_and_an_existing_folder_are_accepted(tmp_path):
    for name in ("vec-ai/lychee-rerank-mm", str(tmp_path)):
        planning.check_model_source(name)


def test_an_empty_training_table_stops_before_any_launch_naming_where_the_reasons_are(tmp_path):
    """Every record quarantined (a wrong data.image_roots): one line naming the datasets that hold the reasons,
    before a stage is launched (whose ranks failed on 'BatchSize must be greater than 0'); nothing is written."""
    empty = pa.Table.from_pylist([], schema=make_table(tmp_path).schema)
    plan = stage_plan(tmp_path)
    with pytest.raises(ValueError, match="training split has no records.*quarantined_records.parquet.*image not found"):
        nodes.export_training_table(empty, plan)
    assert not list(Path(plan.run_dir).rglob("train.parquet"))
