"""The demo catalogue: deterministic bytes, safe caching, and learnable content."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from lychee_pipeline.data.catalogue import (
    COLOURS,
    MARKER,
    default_params,
    draw_product,
    ensure_demo_data,
    make_products,
    make_records,
)
from lychee_pipeline.pipelines.demo_data.nodes import generate_demo_data

SMALL = {"n_products": 48, "n_records": 120}


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_gives_the_same_bytes(tmp_path):
    ensure_demo_data({**SMALL, "out_dir": str(tmp_path / "a")})
    ensure_demo_data({**SMALL, "out_dir": str(tmp_path / "b")})
    ensure_demo_data({**SMALL, "out_dir": str(tmp_path / "c"), "seed": 43})
    a, b, c = (_digest(tmp_path / x) for x in "abc")
    assert a == b and len(a) == 48 + 2
    assert a["records.jsonl"] != c["records.jsonl"]


def test_rerun_is_cached_and_params_change_regenerates(tmp_path):
    out = tmp_path / "demo"
    assert generate_demo_data({**SMALL, "out_dir": str(out)})["generated"] is True
    before = (out / "records.jsonl").stat().st_mtime_ns
    assert ensure_demo_data({**SMALL, "out_dir": str(out)})["generated"] is False
    assert (out / "records.jsonl").stat().st_mtime_ns == before
    changed = ensure_demo_data({**SMALL, "n_products": 30, "out_dir": str(out)})
    assert changed["generated"] is True and len(list((out / "images").iterdir())) == 30
    assert json.loads((out / MARKER).read_text())["complete"] is True


def test_never_writes_into_a_folder_it_did_not_make(tmp_path):
    out = tmp_path / "user_data"
    out.mkdir()
    (out / "mine.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match="refusing"):
        ensure_demo_data({**SMALL, "out_dir": str(out)})
    assert [p.name for p in out.iterdir()] == ["mine.jsonl"]


def test_records_have_hard_and_random_negatives_and_all_query_kinds():
    params = {"seed": 1, "n_products": 320, "n_records": 400, "zipf_exponent": 1.1, "n_hard_negatives": 4,
              "n_random_negatives": 3, "query_mix": {"en": 0.5, "zh": 0.3, "image": 0.1, "image_text": 0.1},
              "doc_mix": {"image_text": 0.7, "text": 0.15, "image": 0.15}}
    products = make_products(params)
    assert abs(sum(p.popularity for p in products) - 1) < 1e-5
    assert max(p.clicks for p in products) > 20 * sorted(p.clicks for p in products)[len(products) // 2]  # long tail
    by_id = {p.product_id: p for p in products}
    records = make_records(products, params)
    kinds = {"zh": 0, "en": 0, "image": 0, "image_text": 0}
    for record in records:
        pos = by_id[record["pos_doc"]["id"]]
        hard = [by_id[d["id"]] for d in record["neg_docs"] if d["hard"]]
        rand = [by_id[d["id"]] for d in record["neg_docs"] if not d["hard"]]
        assert len(hard) == 4 and len(rand) == 3
        assert all((h.category == pos.category) != (h.colour == pos.colour) for h in hard)
        assert all(not (r.category == pos.category and r.colour == pos.colour) for r in rand)
        query = record["query"]
        if isinstance(query, str):
            zh = any("\u4e00" <= ch <= "\u9fff" for ch in query)
            kinds["zh" if zh else "en"] += 1
            assert pos.words(zh)["colour"] in query and pos.words(zh)["category"] in query  # learnable from text
        else:
            kinds["image_text" if "text" in query else "image"] += 1
            assert query["image"] == pos.image
    assert all(n > 0 for n in kinds.values())


def test_images_encode_colour_and_category():
    products = make_products({"seed": 0, "n_products": 1280, "zipf_exponent": 1.0})
    red = next(p for p in products if COLOURS[p.colour][0] == "red" and p.material == 0)
    blue = next(p for p in products if COLOURS[p.colour][0] == "blue" and p.category == red.category
                and p.material == 0 and p.style == red.style)
    other = next(p for p in products if p.colour == red.colour and p.category != red.category
                 and p.material == 0 and p.style == red.style)
    a, b, c = (draw_product(p) for p in (red, blue, other))
    assert a.size == (64, 64) and a.mode == "RGB"
    for image, product in ((a, red), (b, blue)):
        colours = dict((rgb, n) for n, rgb in image.getcolors())
        assert COLOURS[product.colour][2] in colours and len(colours) == 2  # background + plain fill (cotton)
    assert list(a.getdata()) != list(c.getdata())  # another category: another shape, same fill colour


def test_default_size_is_generated_in_seconds_and_decodes(tmp_path):
    summary = ensure_demo_data({"out_dir": str(tmp_path / "demo")})
    assert summary["records"] == 2400 and summary["images"] == 320
    for path in sorted((tmp_path / "demo" / "images").iterdir())[:20]:
        with Image.open(path) as image:
            image.load()
            assert image.size == (64, 64)


def test_defaults_match_the_parameters_file():
    conf = Path(__file__).resolve().parents[2] / "conf" / "base" / "parameters_demo_data.yml"
    assert yaml.safe_load(conf.read_text(encoding="utf-8"))["demo_data"] == default_params()
