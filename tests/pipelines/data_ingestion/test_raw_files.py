"""Files that must not vanish: compressed, other extensions, hidden folders, folder exports, other encodings.

Every file found is listed in raw_files with its line counts (read) or its reason (skipped), and the count
invariant holds over all files read.
"""

from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path

import pytest

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_files, locate_raw_data
from lychee_pipeline.data.records import discover_files


def _lines(tag: str, n: int) -> bytes:
    return b"".join(json.dumps({"query": f"{tag} query {i}", "pos_doc": {"text": f"{tag} doc {i}"},
                                "neg_docs": [{"text": f"{tag} neg {i}"}]}).encode() + b"\n" for i in range(n))


@pytest.fixture
def awkward_folder(tmp_path: Path) -> dict:
    raw = tmp_path / "raw"
    (raw / "export.jsonl").mkdir(parents=True)
    (raw / ".ipynb_checkpoints").mkdir()
    (raw / "images").mkdir()
    (raw / "plain.jsonl").write_bytes(_lines("plain", 3))
    (raw / "upper.JSONL").write_bytes(_lines("upper", 2))
    (raw / "lines.ndjson").write_bytes(_lines("nd", 2))
    (raw / "part.jsonl.gz").write_bytes(gzip.compress(_lines("gz", 4) + b"{bad json\n"))
    (raw / "part.jsonl.bz2").write_bytes(bz2.compress(_lines("bz", 2)))
    (raw / "export.jsonl" / "part-00000").write_bytes(_lines("spark0", 2))
    (raw / "export.jsonl" / "part-00001.json.gz").write_bytes(gzip.compress(_lines("spark1", 3)))
    (raw / "export.jsonl" / "_SUCCESS").write_bytes(b"")
    (raw / "export.jsonl" / "README.md").write_text("# export")
    (raw / "export.jsonl" / ".part-00000.crc").write_bytes(b"crc")
    (raw / ".ipynb_checkpoints" / "plain-checkpoint.jsonl").write_bytes(_lines("plain", 3))
    (raw / "utf16.jsonl").write_bytes(_lines("u16", 2).decode().encode("utf-16"))  # with BOM
    (raw / "notes.txt").write_text("hello")
    (raw / "array.json").write_text("[]")
    (raw / "images" / "a.png").write_bytes(b"png")
    read = {"plain.jsonl": 3, "upper.JSONL": 2, "lines.ndjson": 2, "part.jsonl.gz": 5, "part.jsonl.bz2": 2,
            "export.jsonl/part-00000": 2, "export.jsonl/part-00001.json.gz": 3}
    skipped = {".ipynb_checkpoints/": "hidden folder", "export.jsonl/_SUCCESS": "metadata file",
               "export.jsonl/.part-00000.crc": "hidden file",
               "export.jsonl/README.md": "not a part file", "utf16.jsonl": "encoding UTF-16 LE",
               "notes.txt": "not a JSON lines file", "array.json": "extension .json is not read"}
    return {"raw": raw, "read": read, "skipped": skipped}


def _rel(raw: Path, file: str) -> str:
    return file[len(str(raw)) + 1:]


def test_every_file_is_read_or_skipped_with_a_reason(awkward_folder):
    raw = awkward_folder["raw"]
    source = locate_raw_data({"raw_path": str(raw)}, {})
    table, rejected, counts, raw_files, _ = ingest_files(source, {"workers": 1})
    listed = {_rel(raw, e["file"]): e for e in raw_files["files"]}
    assert set(listed) == set(awkward_folder["read"]) | set(awkward_folder["skipped"])
    for name, lines in awkward_folder["read"].items():
        assert listed[name]["status"] == "read" and listed[name]["lines"] == lines, listed[name]
    for name, reason in awkward_folder["skipped"].items():
        assert listed[name]["status"] == "skipped" and reason in listed[name]["reason"], listed[name]
    assert listed["part.jsonl.gz"]["compression"] == "gzip" and listed["part.jsonl.bz2"]["compression"] == "bzip2"
    assert raw_files["image_files"] == 1 and raw_files["read"] == len(awkward_folder["read"])
    assert counts["lines_in"] == sum(awkward_folder["read"].values())
    assert counts["lines_in"] == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert counts["rejected"] == 1 and rejected[0]["file"].endswith("part.jsonl.gz") and rejected[0]["line"] == 5
    assert sum(e["clean"] for e in raw_files["files"] if e["status"] == "read") == counts["clean"] == table.num_rows
    assert counts["duplicates"] == 0  # the checkpoint copy of plain.jsonl was not read
    texts = {r["query"]["text"] for r in table.to_pylist()}
    assert {"gz query 3", "bz query 1", "spark1 query 2", "upper query 0", "nd query 1"} <= texts


def test_a_folder_export_named_jsonl_and_a_gz_raw_path(awkward_folder):
    raw = awkward_folder["raw"]
    assert [_rel(raw, f) for f in discover_files(str(raw / "export.jsonl"))["files"]] == [
        "export.jsonl/part-00000", "export.jsonl/part-00001.json.gz"]
    assert len(discover_files(str(raw / "*.jsonl"))["files"]) == 3  # plain.jsonl + the export's two parts
    source = locate_raw_data({"raw_path": str(raw / "part.jsonl.gz")}, {})
    _, rejected, counts, raw_files, _ = ingest_files(source, {})
    assert counts["lines_in"] == 5 and counts["clean"] == 4 and "malformed JSON" in rejected[0]["reason"]
    assert raw_files["files"][0]["compression"] == "gzip"


def test_duplicate_id_in_a_compressed_file_quotes_the_raw_line(tmp_path):
    line = json.dumps({"id": "x", "query": "q", "pos_doc": {"text": "d"}}).encode()
    other = json.dumps({"id": "x", "query": "other", "pos_doc": {"text": "d"}}).encode()
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(line + b"\n" + other + b"\n"))
    _, rejected, counts, _, _ = ingest_files(locate_raw_data({"raw_path": str(path)}, {}), {})
    assert counts["clean"] == 1 and "duplicate id 'x'" in rejected[0]["reason"] and '"other"' in rejected[0]["raw"]


@pytest.mark.parametrize(("data", "name"), [
    ("utf-16", "UTF-16 LE"), ("utf-16-be-bom", "UTF-16 BE"), ("utf-16-le", "UTF-16 LE without byte-order mark"),
    ("utf-32", "UTF-32 LE")])
def test_a_file_in_another_encoding_is_refused_naming_it(tmp_path, data, name):
    text = _lines("x", 1).decode()
    raw = b"\xfe\xff" + text.encode("utf-16-be") if data == "utf-16-be-bom" else text.encode(data)
    path = tmp_path / "a.jsonl"
    path.write_bytes(raw)
    with pytest.raises(FileNotFoundError, match=f"encoding {name}"):
        locate_raw_data({"raw_path": str(path)}, {})


def test_a_latin1_line_is_refused_naming_the_encoding(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(json.dumps({"query": "café crème", "pos_doc": {"text": "d"}}, ensure_ascii=False)
                     .encode("latin-1") + b"\n" + _lines("ok", 1))
    _, rejected, counts, raw_files, _ = ingest_files(locate_raw_data({"raw_path": str(path)}, {}), {})
    assert counts["lines_in"] == 2 == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert rejected[0]["reason"].startswith("invalid UTF-8 at byte") and "Latin-1" in rejected[0]["reason"]
    assert raw_files["files"][0]["rejected"] == 1 and raw_files["files"][0]["clean"] == 1


@pytest.mark.parametrize("start", [b"BZh", b"BZh9 not bzip2", b"\x1f\x8b not gzip"], ids=["BZh", "BZh9", "gzip_magic"])
def test_text_that_starts_like_a_compressed_file_is_read_as_text(tmp_path, start):
    """Found by the ingestion fuzz: a line starting with bzip2's or gzip's first bytes made the reader open the
    file as compressed and crash on the stream. Only a whole header counts; the line is rejected as text."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(start + b"\n" + _lines("ok", 1))
    _, rejected, counts, raw_files, _ = ingest_files(locate_raw_data({"raw_path": str(path)}, {}), {})
    assert raw_files["files"][0]["compression"] is None
    assert counts["lines_in"] == 2 and counts["clean"] == 1 and counts["rejected"] == 1 and rejected[0]["reason"]


@pytest.mark.parametrize("kind", ["gzip", "bzip2"])
def test_a_compressed_file_cut_short_is_a_one_line_error_naming_it(tmp_path, kind):
    whole = (gzip.compress if kind == "gzip" else bz2.compress)(_lines("cut", 200))
    path = tmp_path / f"a.jsonl.{'gz' if kind == 'gzip' else 'bz2'}"
    path.write_bytes(whole[: len(whole) // 2])
    # gzip fails part-way through the lines (after some were read), bzip2 at its first block (the file is refused)
    error, where = (ValueError, r"a\.jsonl\.gz, after line \d+: ") if kind == "gzip" else (FileNotFoundError, "")
    with pytest.raises(error, match=rf"{where}its {kind} stream is corrupt or cut short \(.+\); re-export"):
        ingest_files(locate_raw_data({"raw_path": str(path)}, {}), {})


def test_a_dangling_symlink_is_skipped_with_its_reason_in_a_data_run(tmp_path):
    """Issue 32 item 5: `broken.jsonl -> nowhere` under data.raw_path crashed locate_raw_data with a
    FileNotFoundError and a 245-line traceback. Now `kedro run --pipelines data` reads the other files and
    lists the link in raw_files.json as skipped, naming where it points."""
    from project_runs import make_project_copy, run_kedro

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "records.jsonl").write_bytes(_lines("ok", 12))
    (raw / "broken.jsonl").symlink_to(tmp_path / "nowhere" / "gone.jsonl")
    root = make_project_copy(tmp_path / "project")
    run_kedro(root, "data", {"data": {"raw_path": str(raw)}})
    raw_files = json.loads((root / "data/02_intermediate/raw_files.json").read_text())
    listed = {Path(e["file"]).name: e for e in raw_files["files"]}
    assert listed["records.jsonl"]["status"] == "read" and listed["records.jsonl"]["lines"] == 12
    assert listed["broken.jsonl"]["status"] == "skipped"
    assert listed["broken.jsonl"]["reason"] == (f"broken symbolic link: it points to {tmp_path / 'nowhere' / 'gone.jsonl'}"
                                                ", which does not exist")
    assert (raw_files["read"], raw_files["skipped"]) == (1, 1)

