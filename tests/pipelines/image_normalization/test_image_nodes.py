"""Image normalization on the bad-input corpus: manifest, quarantine, removed negatives, re-use, policy."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from PIL import Image

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_records
from lychee_pipeline.data.images import Resolver, check_image
from lychee_pipeline.data.normalization import image_refs
from lychee_pipeline.pipelines.image_normalization.nodes import check_images, normalize_records
from lychee_pipeline.schema import MANIFEST_SCHEMA, MODEL_INPUT_SCHEMA

CHECK = {"workers": 1, "max_pixels": 1_000_000}
NORM = {"policy": "quarantine", "min_negatives": 1}


@pytest.fixture
def data_ingested(data_bad_corpus):
    table, _, _ = ingest_records(data_bad_corpus["source"], {})
    return table


def _run(corpus, ingested, previous=None):
    manifest = check_images(ingested, previous, corpus["source"], CHECK)
    return manifest, *normalize_records(ingested, manifest, corpus["source"], NORM)


def test_manifest_has_one_row_per_unique_image_with_reason(data_bad_corpus, data_ingested, caplog):
    with caplog.at_level("INFO", logger="lychee_pipeline.data.normalization"):
        manifest = check_images(data_ingested, None, data_bad_corpus["source"], CHECK)
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("images: "))
    # the unique count is of images found; a newcomer counted the missing ones in it too
    assert first.endswith("(5 other references not resolved: counted below)"), first
    assert manifest.schema.equals(MANIFEST_SCHEMA)
    rows = {os.path.basename(r["path"]): r for r in manifest.to_pylist()}
    # good.png is referenced by many records and checked once; escaped or missing paths never reach the manifest
    assert manifest.num_rows == len(set(manifest.column("path").to_pylist()))
    assert "secret.png" not in rows and "passwd" not in rows and "missing.png" not in rows
    assert rows["zero.png"]["reason"] == "zero-byte file"
    assert rows["truncated.jpg"]["reason"].startswith("corrupt image")
    assert rows["text.jpg"]["reason"] == "not a decodable image"
    assert rows["huge.png"]["reason"].startswith("too many pixels: 3000x3000")
    for ref, mode, fmt in data_bad_corpus["modes"].values():
        row = rows[os.path.basename(ref)]
        assert row["ok"] and row["mode"] == mode and row["format"] == fmt and row["width"] == 16
    assert rows["anim.gif"]["frames"] == 2 and rows["good.png"]["frames"] == 1
    assert rows["good.png"]["ok"] and (rows["good.png"]["width"], rows["good.png"]["height"]) == (32, 32)


def test_records_land_where_they_should(data_bad_corpus, data_ingested):
    manifest, normalized, quarantined, removed, counts = _run(data_bad_corpus, data_ingested)
    reasons = dict(zip(quarantined.column("record_id").to_pylist(), quarantined.column("reason").to_pylist()))
    for rid, expected in data_bad_corpus["quarantined"].items():
        assert expected in reasons[rid], (rid, reasons.get(rid))
    assert set(reasons) == set(data_bad_corpus["quarantined"])
    kept = set(normalized.column("record_id").to_pylist())
    assert data_bad_corpus["clean_ok"] <= kept and not kept & set(reasons)
    assert removed.to_pylist() == [{"record_id": "neg-removed", "doc_id": "bad-neg", "image": "images/text.jpg",
                                    "reason": "not a decodable image: images/text.jpg"}] + [
        {"record_id": "neg-left-none", "doc_id": "zero-neg", "image": "images/zero.png",
         "reason": "zero-byte file: images/zero.png"}]
    assert counts["records_in"] == counts["normalized"] + counts["quarantined"] == data_ingested.num_rows
    assert counts["negatives_removed"] == 2
    assert normalized.schema.equals(MODEL_INPUT_SCHEMA)


def test_normalized_images_are_absolute_checked_files(data_bad_corpus, data_ingested):
    _, normalized, _, _, _ = _run(data_bad_corpus, data_ingested)
    root = str(data_bad_corpus["root"].resolve())
    paths = [p for p in image_refs(normalized)]
    assert paths and all(os.path.isabs(p) and p.startswith(root) and os.path.isfile(p) for p in paths)
    row = {r["record_id"]: r for r in normalized.to_pylist()}["neg-removed"]
    assert [d["text"] for d in row["negatives"]] == ["fine negative"]
    for p in paths:  # every kept image decodes for real; none was replaced
        with Image.open(p) as image:
            image.load()


def test_manifest_is_reused_for_unchanged_files(data_bad_corpus, data_ingested):
    manifest = check_images(data_ingested, None, data_bad_corpus["source"], CHECK)
    good = str((data_bad_corpus["root"] / "images" / "good.png").resolve())
    marked = [dict(r, width=999) if r["path"] == good else r for r in manifest.to_pylist()]
    previous = pa.Table.from_pylist(marked, schema=MANIFEST_SCHEMA)
    reused = {r["path"]: r for r in check_images(data_ingested, previous, data_bad_corpus["source"], CHECK).to_pylist()}
    assert reused[good]["width"] == 999  # not re-checked: same size and mtime
    st = os.stat(good)
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again = {r["path"]: r for r in check_images(data_ingested, previous, data_bad_corpus["source"], CHECK).to_pylist()}
    assert again[good]["width"] == 32  # mtime changed: checked again
    stricter = check_images(data_ingested, previous, data_bad_corpus["source"], {**CHECK, "max_pixels": 100})
    assert not {r["path"]: r for r in stricter.to_pylist()}[good]["ok"]  # another pixel limit: checked again


def test_policy_fail_raises_with_the_reason(data_bad_corpus, data_ingested):
    manifest = check_images(data_ingested, None, data_bad_corpus["source"], CHECK)
    with pytest.raises(ValueError, match="policy is 'fail'"):
        normalize_records(data_ingested, manifest, data_bad_corpus["source"], {**NORM, "policy": "fail"})
    with pytest.raises(ValueError, match="quarantine"):
        normalize_records(data_ingested, manifest, data_bad_corpus["source"], {**NORM, "policy": "skip"})


def test_process_pool_gives_the_same_manifest(tmp_path):
    images = tmp_path / "img"
    images.mkdir()
    refs = []
    for i in range(80):
        Image.new("RGB", (8 + i % 5, 8), (i, 0, 0)).save(images / f"{i}.png")
        refs.append({"text": None, "image": f"img/{i}.png"})
    (images / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    table = pa.Table.from_pylist(
        [{"record_id": str(i), "query": {"text": "q", "image": None},
          "positives": [{"doc_id": "d", **ref, "meta": "{}"}], "negatives": [], "task_type": "t2i",
          "language": "en", "split": None} for i, ref in enumerate(refs + [{"text": None, "image": "img/bad.png"}])],
        schema=MODEL_INPUT_SCHEMA)
    source = {"image_roots": [str(tmp_path)]}
    serial = check_images(table, None, source, {"workers": 1, "max_pixels": 10**6})
    pooled = check_images(table, None, source, {"workers": 2, "max_pixels": 10**6})
    assert serial.equals(pooled) and pooled.num_rows == 81
    assert pooled.to_pylist()[-1]["reason"] == "not a decodable image"


def test_resolver_tries_each_root_and_confines(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.png").write_bytes(b"")
    resolver = Resolver([str(tmp_path / "a"), str(tmp_path / "b")])
    assert resolver.resolve("x.png") == (str((tmp_path / "b" / "x.png").resolve()), None)
    assert resolver.resolve(str(tmp_path / "b" / "x.png"))[0] is not None  # absolute, inside a root
    assert "escapes" in resolver.resolve("/etc/hostname")[1]
    assert "escapes" in resolver.resolve("../b/../../etc/passwd")[1]
    assert resolver.resolve("y.png") == (None, "image not found: y.png")


def test_check_image_missing_file(tmp_path):
    assert check_image(str(tmp_path / "nope.png"), 100)["reason"] == "image not found"


def test_image_path_in_the_other_unicode_normalization_is_found(tmp_path):
    import json
    import unicodedata

    nfc = lambda s: unicodedata.normalize("NFC", s)  # noqa: E731
    nfd = lambda s: unicodedata.normalize("NFD", s)  # noqa: E731
    root = tmp_path / "export"
    (root / nfd("Crème")).mkdir(parents=True)  # as macOS writes names: decomposed (NFD)
    (root / nfc("Été")).mkdir()  # a folder in NFC holding a file in NFD: matched part by part
    files = {"nfd_file": root / nfd("Crème") / nfd("café-brûlé.png"),
             "mixed": root / nfc("Été") / nfd("rosé.png"),
             "nfc_file": root / nfc("ñandú.png")}
    for path in files.values():
        Image.new("RGB", (16, 16), (200, 10, 10)).save(path)
    assert os.fsencode(files["nfd_file"].name) != os.fsencode(nfc(files["nfd_file"].name))  # really NFD on disk
    refs = {"nfd_file": nfc("Crème/café-brûlé.png"), "mixed": nfc("Été/rosé.png"), "nfc_file": nfd("ñandú.png"),
            "absolute": str(root / nfc("Crème") / nfc("café-brûlé.png")), "missing": nfc("Crème/thé.png")}
    lines = [json.dumps({"id": rid, "query": "q", "pos_doc": {"text": "d", "image": ref}, "neg_docs": [{"text": "n"}]})
             for rid, ref in refs.items()]
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    source = {"files": [str(jsonl)], "image_roots": [str(root)], "demo": False}
    table, _, _ = ingest_records(source, {})
    manifest = check_images(table, None, source, CHECK)
    assert sorted(manifest.column("path").to_pylist()) == sorted(str(p.resolve()) for p in files.values())
    assert all(manifest.column("ok").to_pylist())
    normalized, quarantined, _, counts = normalize_records(table, manifest, source, NORM)
    assert counts["records_in"] == counts["normalized"] + counts["quarantined"]
    found = {r["record_id"]: r["positives"][0]["image"] for r in normalized.to_pylist()}
    expected = {k: str(p.resolve()) for k, p in files.items()} | {"absolute": str(files["nfd_file"].resolve())}
    assert found == expected  # the path on disk, in the form the file system holds
    assert quarantined.to_pylist()[0]["reason"].startswith("positive ") and "image not found" in \
        quarantined.to_pylist()[0]["reason"]
    assert Resolver([str(root)]).resolve(nfc("../export/Crème/café-brûlé.png"))[0] == str(files["nfd_file"].resolve())
    assert Resolver([str(root / nfc("Été"))]).resolve(nfc("../Crème/café-brûlé.png"))[1].startswith("path escapes")
