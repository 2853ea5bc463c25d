"""Property-based fuzz of JSONL ingestion: any bytes per line either ingest or are rejected with a reason.

Never an unhandled exception, and lines_in == clean + rejected + duplicates, whatever the lines are: random
bytes, random JSON values, and near-valid records with tricky strings (lone surrogate escapes, NUL, RTL,
huge numbers, deep nesting), repeated to exercise deduplication.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_records
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

EXAMPLES = 150  # bounded: ~10-20 s on 2 cores
SEEN = {"lines": 0, "examples": 0, "clean": 0, "rejected": 0, "duplicates": 0}

TRICKY = st.sampled_from([
    "", " ", "red dress", "红色连衣裙", "\u202eevil", "a\u0000b", "e\u0301", "\ufeffbom", "x" * 3000,
    "../../etc/passwd", "/etc/hostname", "images/a.png", "C:\\\\x.png",
])
# JSON source fragments (not Python strings): escapes that decode to lone surrogates or control characters
RAW_STRINGS = st.sampled_from(['"\\ud800"', '"\\udfff x"', '"\\u0000"', '"ok"', '"\\ud83d\\ude00"', '1e999', "-0",
                               "123456789012345678901234567890", "null", "true", "[]", "{}"])


def _item():
    return st.one_of(TRICKY, st.none(), st.integers(), st.fixed_dictionaries(
        {}, optional={"text": st.one_of(TRICKY, st.none(), st.integers()), "image": st.one_of(TRICKY, st.none()),
                      "id": TRICKY, "hard": st.one_of(st.booleans(), TRICKY), "meta": st.one_of(
                          st.dictionaries(TRICKY, st.one_of(TRICKY, st.integers(), st.floats())), TRICKY)}))


RECORD = st.fixed_dictionaries(
    {"query": _item()},
    optional={"id": st.one_of(TRICKY, st.integers()), "pos_doc": _item(), "pos_docs": st.lists(_item(), max_size=3),
              "neg_docs": st.one_of(st.lists(_item(), max_size=4), _item()),
              "split": st.sampled_from(["train", "val", "test", "TRAIN", None, 3]), "extra": st.integers()},
)
TEXT = st.one_of(TRICKY, st.text(max_size=20))
DOC = st.fixed_dictionaries({"text": TEXT}, optional={"image": TRICKY, "id": TEXT, "meta": st.dictionaries(
    TEXT, st.one_of(TEXT, st.integers(), st.floats(allow_nan=False)), max_size=2), "hard": st.booleans()})
VALIDISH = st.fixed_dictionaries(  # mostly valid records: these ingest, or collide on id / content
    {"query": st.one_of(TEXT, st.fixed_dictionaries({"text": TEXT}, optional={"image": TRICKY})),
     "pos_doc": DOC, "neg_docs": st.lists(DOC, max_size=3)},
    optional={"id": st.sampled_from(["a", "b", " a ", "c"]), "split": st.sampled_from(["train", "val", "test"])},
)
JSON_VALUE = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | TRICKY,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
                          max_leaves=8)


@st.composite
def raw_line(draw) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=80)).replace(b"\n", b"")
    if kind == 1:
        return json.dumps(draw(JSON_VALUE), ensure_ascii=draw(st.booleans())).encode()
    if kind == 2:  # a record with a raw JSON fragment spliced into one field
        text = json.dumps(draw(RECORD))
        field = draw(st.sampled_from(['"query"', '"text"', '"image"', '"id"']))
        at = text.find(field + ": ")
        if at >= 0:
            head, tail = text[: at + len(field) + 2], text[at + len(field) + 2:]
            tail = tail.split(",", 1)[1] if "," in tail else "}"
            text = head + draw(RAW_STRINGS) + ("," + tail if not tail.startswith("}") else tail)
        return text.encode("utf-8", errors="surrogatepass")
    if kind == 3:  # deep nesting
        depth = draw(st.integers(50, 400))
        return b'{"query": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 4:
        return json.dumps(draw(RECORD), ensure_ascii=draw(st.booleans())).encode("utf-8", errors="surrogatepass")
    return json.dumps(draw(VALIDISH), ensure_ascii=draw(st.booleans())).encode()


LINES = st.lists(raw_line(), min_size=1, max_size=16).flatmap(
    lambda pool: st.lists(st.sampled_from(pool), min_size=1, max_size=24))  # repeats -> duplicates


VALID = {"query": "red dress", "pos_doc": {"text": "a red dress"}, "neg_docs": [{"text": "a blue shirt"}]}


@pytest.mark.parametrize("fragment,outcome", [
    ('"\\ud800"', "rejected"), ('"\\udfff x"', "rejected"), ('"\\u0000"', "clean"),  # NUL is kept (not whitespace)
    ('"\\ud83d\\ude00"', "clean"), ('"a\\u0000b"', "clean"), ('1e999', "rejected"),
])
def test_escapes_in_the_query(tmp_path, fragment, outcome):
    line = json.dumps(VALID).replace('"red dress"', fragment).encode()
    path = tmp_path / "one.jsonl"
    path.write_bytes(line + b"\n")
    table, rejected, counts = ingest_records({"files": [str(path)], "image_roots": [str(tmp_path)]}, {"workers": 1})
    assert counts[outcome] == 1, (counts, rejected)
    if outcome == "rejected":
        assert rejected[0]["reason"]


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=LINES, crlf=st.booleans(), bom=st.booleans(), trailing_newline=st.booleans())
def _any_bytes_ingest_or_are_rejected_with_a_reason(lines, crlf, bom, trailing_newline):
    end = b"\r\n" if crlf else b"\n"
    body = (b"\xef\xbb\xbf" if bom else b"") + end.join(lines) + (end if trailing_newline else b"")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        path.write_bytes(body)
        table, rejected, counts = ingest_records({"files": [str(path)], "image_roots": [tmp]}, {"workers": 1})
    expected = body.count(b"\n") + (0 if not body or body.endswith(b"\n") else 1)  # what a line reader sees
    assert counts["lines_in"] == expected
    assert counts["lines_in"] == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert table.schema.equals(MODEL_INPUT_SCHEMA) and table.num_rows == counts["clean"]
    assert len(set(table.column("record_id").to_pylist())) == table.num_rows
    for row in rejected:
        assert isinstance(row["reason"], str) and row["reason"].strip(), row
        assert 1 <= row["line"] <= expected
        json.dumps(row, ensure_ascii=False).encode("utf-8")  # the rejected file can be written
    pa.Table.from_pylist(table.to_pylist(), schema=MODEL_INPUT_SCHEMA)  # every value round-trips
    SEEN["lines"] += expected
    SEEN["examples"] += 1
    for key in ("clean", "rejected", "duplicates"):
        SEEN[key] += counts[key]


def test_any_bytes_ingest_or_are_rejected_with_a_reason():
    """Fuzzed files of any bytes: each ingests or is rejected with a reason, with nothing lost. Prints the number of
    fuzzed lines (docs/reliability.md quotes it). The fuzz runs inside this test, so the totals checked below are
    its own whatever ran before it, and on whichever worker."""
    for key in SEEN:
        SEEN[key] = 0
    _any_bytes_ingest_or_are_rejected_with_a_reason()
    print("ingestion fuzz: {examples} files, {lines} lines: {clean} clean, {rejected} rejected, "
          "{duplicates} duplicates".format(**SEEN))
    # the fuzz exercised both outcomes, with nothing lost
    assert SEEN["examples"] >= EXAMPLES // 2 and SEEN["clean"] > 0 and SEEN["rejected"] > 0
    assert SEEN["lines"] == SEEN["clean"] + SEEN["rejected"] + SEEN["duplicates"]
