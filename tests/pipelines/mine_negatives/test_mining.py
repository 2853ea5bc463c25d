"""Hard-negative mining: the first stage, the selection rules, and the whole miner on demo data whose
negatives were removed from the raw records, rescored by the built-in tiny reranker on CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner
from PIL import Image

from lychee_pipeline.datasets import ArrowTableDataset
from lychee_pipeline.mining import (
    ImageIndex,
    MiningParams,
    TextIndex,
    image_signature,
    mine_table,
    model_key,
    normalize_text,
    select_negatives,
    tokenize,
)
from lychee_pipeline.pipelines import data_ingestion, data_split, image_normalization, mine_negatives
from lychee_pipeline.data.catalogue import ensure_demo_data
from lychee_pipeline.reranker.collate import sample_group
from lychee_pipeline.reranker.inference import Reranker
from lychee_pipeline.reranker.tiny import ensure_tiny
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[3]
BASE_PARAMS = yaml.safe_load((ROOT / "conf/base/parameters_mining.yml").read_text())["mining"]
PROCESSING = {"ingestion": {"batch_size": 1000, "workers": 1},
              "image_check": {"workers": 1, "max_pixels": 1_000_000},
              "normalization": {"policy": "quarantine", "min_negatives": 0},
              "split": {"seed": 42, "ratios": {"train": 0.8, "val": 0.1, "test": 0.1}}}
KEEP_OWN_EVERY = 10  # every 10th raw record keeps one negative of its own
RERANKER = {"batch_size": 16, "device": "cpu", "max_pixels": 12544}


def _mining_params(cache: Path, **overrides) -> dict:
    # builtin:tiny has random weights: its p(yes) is about 0.5 for every pair, the positive's included, so
    # relative_margin 1.5 leaves the margin filter to test_margin_filter (a trained base model uses 0.95)
    return {**BASE_PARAMS, "reranker": RERANKER, "cache_path": str(cache), "progress": False, "bm25_k": 30,
            "image_k": 10, "rescore_top": 12, "rank_window": [2, 12], "relative_margin": 1.5, "n_mined": 3,
            "n_random": 3, **overrides}


def _category(meta: str | None) -> str | None:
    return json.loads(meta).get("category") if meta else None


# -- first stage --------------------------------------------------------------------------------------------

def test_tokenize_indexes_cjk_as_characters_and_bigrams():
    assert tokenize("The Red DRESS of silk") == ["red", "dress", "silk"]
    assert tokenize("红色连衣裙") == ["红", "色", "连", "衣", "裙", "红色", "色连", "连衣", "衣裙"]
    docs = ["黑色西装", "红色真丝连衣裙，适合晚宴", "Blue denim shirt", "red silk dress", None]
    index = TextIndex(docs)
    zh, en, nothing = index.search(["红色连衣裙", "a red dress", "!!"], k=3)
    assert zh[0][0] == 1 and all(d != 4 for d, _ in zh)
    assert en[0][0] == 3 and {d for d, _ in en} <= {1, 3}  # the only English docs with 'red' or 'dress'
    assert nothing == []
    assert normalize_text("  Red\u3000DRESS ") == "red dress"


def _pattern(colour, size=96, stripes=4):
    pixels = np.full((size, size, 3), 255, np.uint8)
    for i in range(stripes):
        pixels[:, i * size // stripes : i * size // stripes + size // (2 * stripes)] = colour
    pixels[size // 3 : 2 * size // 3, size // 4 : size // 2] = (0, 0, 0)
    return Image.fromarray(pixels)


def test_image_signature_and_neighbours(tmp_path):
    paths = {}
    _pattern((200, 30, 30)).save(tmp_path / "red.png")
    _pattern((200, 30, 30)).resize((80, 80)).save(tmp_path / "red_copy.jpg", quality=90)  # re-encoded copy
    _pattern((30, 30, 200)).save(tmp_path / "blue.png")  # the same picture in another colour
    _pattern((200, 30, 30), stripes=9).transpose(Image.Transpose.ROTATE_90).save(tmp_path / "other.png")
    for name in ("red.png", "red_copy.jpg", "blue.png", "other.png"):
        paths[name] = image_signature(str(tmp_path / name))
    dist = lambda a, b: bin(paths[a][0] ^ paths[b][0]).count("1")  # noqa: E731
    colour = lambda a, b: max(abs(x - y) for x, y in zip(paths[a][1], paths[b][1]))  # noqa: E731
    assert dist("red.png", "red_copy.jpg") <= 4 and colour("red.png", "red_copy.jpg") <= 6
    assert colour("red.png", "blue.png") > 6  # pHash is grey-level: the colour tells these apart
    assert dist("red.png", "other.png") > 10
    index = ImageIndex([10, 11, 12], [paths["red_copy.jpg"][0], paths["other.png"][0], paths["blue.png"][0]])
    (found,) = index.search([{paths["red.png"][0]}], k=2)
    assert found[0][0] in (10, 12) and 11 not in [d for d, _ in found]


# -- selection ------------------------------------------------------------------------------------------

def test_select_negatives_rank_window_and_false_negatives():
    ranked = [(d, 1.0 - d / 10) for d in range(8)]  # doc d has rank d + 1
    dupes = {3: "same text as a positive"}
    out = select_negatives(ranked, (2, 6), 2, lambda d, s: dupes.get(d))
    kept = [d for d, rank, s, k, reason in out if k]
    assert kept == [1, 2]
    reasons = {d: reason for d, rank, s, k, reason in out}
    assert reasons[0].startswith("above the rank window") and reasons[3] == "same text as a positive"
    assert reasons[4] == "enough mined negatives" and reasons[6].startswith("below the rank window")
    # the rank counts filtered candidates too: filters never pull a lower-ranked one into the window
    out = select_negatives(ranked, (2, 3), 5, lambda d, s: "x" if d == 1 else None)
    assert [d for d, *_, k, _ in out if k] == [2]


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="rank_window"):
        MiningParams(rank_window=(5, 2))
    with pytest.raises(ValueError, match="rescore_top"):
        MiningParams(rank_window=(1, 40), rescore_top=30)
    with pytest.raises(ValueError):
        MiningParams(n_mined=2, unknown=1)
    assert MiningParams(**BASE_PARAMS).rank_window == tuple(BASE_PARAMS["rank_window"])


# -- the miner on demo data without negatives ---------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_train(tmp_path_factory):
    """The demo catalogue with negatives removed from the raw records (every 10th keeps one of its own),
    through ingestion, normalization and the split: the train split."""
    root = tmp_path_factory.mktemp("mining_demo")
    summary = ensure_demo_data({"out_dir": str(root / "demo"), "seed": 3, "n_products": 60, "n_records": 120})
    raw = root / "raw" / "records.jsonl"
    raw.parent.mkdir()
    lines = []
    for i, line in enumerate(Path(summary["files"][0]).read_text(encoding="utf-8").splitlines()):
        record = json.loads(line)
        own = record.pop("neg_docs", [])
        if i % KEEP_OWN_EVERY == 0 and own:
            record["neg_docs"] = own[:1]
        lines.append(json.dumps(record, ensure_ascii=False))
    raw.write_text("\n".join(lines) + "\n", encoding="utf-8")
    datasets = {"params:data": {"raw_path": str(raw), "image_roots": [str(root / "demo")]}, "params:demo_data": {},
                **{f"params:data_processing.{k}": v for k, v in PROCESSING.items()}, "params:smoke.sample_size": 50}
    catalog = DataCatalog({k: MemoryDataset(v) for k, v in datasets.items()})
    catalog["previous_image_manifest"] = ArrowTableDataset(str(root / "manifest.parquet"), missing_ok=True)
    catalog["train_records"] = ArrowTableDataset(str(root / "train.parquet"))
    pipe = data_ingestion.create_pipeline() + image_normalization.create_pipeline() + data_split.create_pipeline()
    SequentialRunner().run(pipe, catalog)
    train = catalog.load("train_records")
    assert train.num_rows > 60
    return {"root": root, "train": train, "tiny": str(ensure_tiny(root / "tiny"))}


def _factory(tiny: str):
    return lambda: Reranker.from_pretrained("builtin:tiny", tiny_cache_dir=tiny, **RERANKER)


@pytest.fixture(scope="module")
def mined(demo_train):
    cache = demo_train["root"] / "cache.sqlite"
    params = _mining_params(cache)
    key = model_key("builtin:tiny", None, RERANKER, None)
    result = mine_table(demo_train["train"], params, _factory(demo_train["tiny"]), key)
    return {**demo_train, "result": result, "params": params, "key": key, "cache": cache}


def _added(row, source):
    return [n for n in row["negatives"] if n["meta"] and json.loads(n["meta"]).get("mining", {}).get("source") == source]


def test_mined_negatives_are_hard_and_never_a_positive_or_near_duplicate(mined):
    train, result, params = mined["train"], mined["result"], MiningParams(**mined["params"])
    table = result.table
    assert table.schema.equals(MODEL_INPUT_SCHEMA)
    assert table.column("record_id").to_pylist() == train.column("record_id").to_pylist()
    assert table.drop_columns(["negatives"]).equals(train.drop_columns(["negatives"]))
    pool = {d["doc_id"] for r in train.to_pylist() for d in r["positives"] + r["negatives"]}

    rows, before = table.to_pylist(), train.to_pylist()
    mined_negs, random_negs = [], []
    for row, old in zip(rows, before):
        own = old["negatives"]
        assert row["negatives"][: len(own)] == own  # the user's own negatives first, untouched
        m, rnd = _added(row, "mined"), _added(row, "random")
        assert len(row["negatives"]) == len(own) + len(m) + len(rnd) and len(m) <= params.n_mined
        # random ones fill in for mined ones that ran short: every query gets n_mined + n_random
        assert len(m) + len(rnd) == params.n_mined + params.n_random
        assert sum(1 for n in rnd if json.loads(n["meta"])["mining"].get("fill")) == params.n_mined - len(m)
        assert all(n["hard"] for n in m) and not any(n["hard"] for n in rnd)
        ids = [n["doc_id"] for n in row["negatives"]]
        assert len(ids) == len(set(ids))  # nothing added twice, nothing the user already gave
        pos_ids = {p["doc_id"] for p in row["positives"]}
        pos_text = {normalize_text(p["text"]) for p in row["positives"]} - {""}
        pos_sig = [image_signature(p["image"]) for p in row["positives"] if p["image"]]
        for n in m + rnd:
            assert n["doc_id"] in pool  # from the train split's own documents only
            assert n["doc_id"] not in pos_ids and normalize_text(n["text"]) not in pos_text
            if n["image"]:
                sig = image_signature(n["image"])
                for ps in pos_sig:
                    near = (bin(sig[0] ^ ps[0]).count("1") <= params.near_duplicate_distance
                            and max(abs(a - b) for a, b in zip(sig[1], ps[1])) <= params.near_duplicate_colour)
                    assert not near, (row["record_id"], n["doc_id"])
            mark = json.loads(n["meta"])["mining"]
            assert 0.0 <= mark["score"] <= 1.0
            if mark["source"] == "mined":
                assert params.rank_window[0] <= mark["rank"] <= params.rank_window[1]
        mined_negs += [(row, n) for n in m]
        random_negs += [(row, n) for n in rnd]
    assert result.counts["random_fill"] == sum(params.n_mined - len(_added(r, "mined")) for r in rows)
    n_rows = len(rows)
    assert len(mined_negs) >= 0.8 * params.n_mined * n_rows
    assert len(random_negs) == params.n_random * n_rows + result.counts["random_fill"]

    # The base model, scoring afresh (no cache): mined negatives score higher than random ones.
    reranker = _factory(mined["tiny"])()
    sample_m, sample_r = mined_negs[::4][:60], random_negs[::4][:60]
    pairs = [(r["query"], {"text": n["text"], "image": n["image"]}) for r, n in sample_m + sample_r]
    fresh = reranker.score_pairs(pairs)
    recorded = [json.loads(n["meta"])["mining"]["score"] for _, n in sample_m + sample_r]
    assert np.allclose(fresh, recorded, atol=2e-3)
    assert np.mean(fresh[: len(sample_m)]) > np.mean(fresh[len(sample_m):])
    # and independently of the model: the first stage finds documents of the positive's category
    same = lambda negs: np.mean([_category(n["meta"]) == _category(r["positives"][0]["meta"]) for r, n in negs])  # noqa: E731
    assert same(mined_negs) > 2 * same(random_negs) and same(mined_negs) > 0.3

    counts = result.counts
    assert counts["mined"] == len(mined_negs) and counts["random"] == len(random_negs)
    logged = result.log_table.to_pylist()
    assert sum(1 for x in logged if x["source"] == "mined" and x["kept"]) == counts["mined"]
    filtered = [x for x in logged if x["reason"] and not x["reason"].startswith(("above", "below", "enough"))]
    assert len(filtered) == counts["false_negatives"] > 0
    assert counts["fn_near_image"] > 0 and counts["fn_margin"] == 0
    assert counts["pairs_scored"] > 0 and counts["mean_score_mined"] > counts["mean_score_random"]


def test_margin_filter(mined):
    """Scores above relative_margin x the positive's are dropped as likely false negatives (cached scores)."""
    part = mined["train"]  # the same documents as the first run: every candidate's score is cached
    strict = mine_table(part, {**mined["params"], "relative_margin": 0.5, "fill_with_random": False},
                        _factory(mined["tiny"]), mined["key"])
    counts = strict.counts
    assert counts["pairs_scored"] == 0  # all cached by the first run
    assert counts["mined"] == 0 and counts["fn_margin"] > 0
    assert counts["false_negatives"] == counts["rescored_candidates"]
    for row in strict.log_table.to_pylist():
        if row["source"] == "mined" and row["reason"].startswith("score"):
            score, positive = (float(x) for x in re.findall(r"\d\.\d+", row["reason"])[::2])
            assert score > 0.5 * positive


def test_rerun_takes_every_score_from_the_cache(mined):
    def no_model():
        raise AssertionError("a re-run with the same model and data must not load the reranker")

    again = mine_table(mined["train"], mined["params"], no_model, mined["key"])
    assert again.table.equals(mined["result"].table)
    assert again.counts["pairs_scored"] == 0 and again.counts["images_hashed"] == 0
    assert again.counts["pairs_from_cache"] == again.counts["pairs"] == mined["result"].counts["pairs"]
    # streamed in batches of 7 queries: the same result (draws are per record, scores per pair)
    streamed = mine_table(mined["train"], {**mined["params"], "batch_queries": 7}, no_model, mined["key"])
    assert streamed.table.equals(mined["result"].table) and streamed.log_table.equals(mined["result"].log_table)
    # another model key (another model or image budget) is scored afresh
    with pytest.raises(AssertionError, match="must not load"):
        mine_table(mined["train"].slice(0, 3), mined["params"], no_model, mined["key"] + "other")


def test_training_reads_the_mined_table(mined, tmp_path):
    from lychee_pipeline.pipelines.training.nodes import export_training_table, plan_training

    table = mined["result"].table
    full = table.filter(pa.compute.greater_equal(pa.compute.list_value_length(table.column("negatives")), 6))
    plan = plan_training({}, {"group_size": 7}, {}, 1, "cpu", {"name": "mined", "output_root": str(tmp_path)})
    path = export_training_table(full, plan)
    assert pa.parquet.read_table(path).schema.equals(MODEL_INPUT_SCHEMA)
    rows = [r for r in full.to_pylist() if len(_added(r, "mined")) == 3 and len(r["negatives"]) == 6]
    assert rows
    group = sample_group(rows[0], 7)  # the trainer's sampler: hard (mined) first up to half, then random
    chosen = {(d["text"], d["image"]) for d in group["docs"][1:]}
    assert chosen == {(n["text"], n["image"]) for n in rows[0]["negatives"]}


def test_pipeline_passes_through_when_off_and_mines_when_on(mined, tmp_path):
    train = mined["train"].slice(0, 12)
    params = _mining_params(tmp_path / "cache.sqlite", reranker={**RERANKER, "tiny_cache_dir": mined["tiny"]})
    for enabled in (False, True):
        catalog = DataCatalog({"train_records": MemoryDataset(train), "params:model": MemoryDataset({"name_or_path": "builtin:tiny"}),
                               "params:mining": MemoryDataset({**params, "enabled": enabled})})
        for name in mine_negatives.pipeline.OUTPUTS:
            catalog[name] = MemoryDataset()
        SequentialRunner().run(mine_negatives.create_pipeline(), catalog)
        out, counts = catalog.load("mined_train_records"), catalog.load("mining_counts")
        assert counts["enabled"] is enabled
        if not enabled:
            assert out.equals(train) and catalog.load("mining_log").num_rows == 0
        else:
            assert counts["mined"] > 0 and counts["model"] == "builtin:tiny"
            assert sum(len(n) for n in out.column("negatives").to_pylist()) > sum(len(n) for n in train.column("negatives").to_pylist())
        plot = catalog.load("mining_plot")
        assert plot.axes
        if not enabled:  # no empty chart: a page that says mining was off (data/08_reporting/mining_scores.png)
            assert not plot.axes[0].axison and not plot.axes[0].patches
            assert "Mining was off in this run" in " ".join(t.get_text() for t in plot.axes[0].texts)


def test_mining_sits_between_split_and_training_on_the_train_split_only():
    from lychee_pipeline.pipeline_registry import register_pipelines

    pipes = register_pipelines()
    for name, source in (("full", "train_records"), ("smoke", "smoke_train_records")):
        nodes = {n.name: n for n in pipes[name].nodes}
        assert set(nodes["mining.mine_negatives"].inputs) == {source, "params:mining", "params:model"}
        assert "mined_train_records" in nodes["training.export_training_table"].inputs
        for node in pipes[name].nodes:  # nothing else feeds training from the unmined tables
            if "training" in node.tags:
                assert not {"train_records", "smoke_train_records", "val_records", "test_records"} & set(node.inputs)
    assert BASE_PARAMS["enabled"] is False and BASE_PARAMS["smoke_enabled"] is False


def test_image_hashes_in_worker_processes_equal_serial_and_are_cached(tmp_path):
    from lychee_pipeline.mining.cache import MiningCache
    from lychee_pipeline.mining.mine import _signatures

    rng = np.random.default_rng(0)
    paths = []
    for i in range(300):  # more than one chunk of 256
        path = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((32, 32)).save(path)
        paths.append(str(path))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    paths.append(str(tmp_path / "broken.png"))
    with MiningCache(None) as serial_cache:
        serial, n = _signatures(paths, serial_cache, 8, progress=False, workers=1)
    with MiningCache(tmp_path / "cache.sqlite") as cache:
        parallel, n_parallel = _signatures(paths, cache, 8, progress=False, workers=2)
        again, n_again = _signatures(paths, cache, 8, progress=False, workers=2)
    assert serial == parallel == again and len(serial) == 300 and str(tmp_path / "broken.png") not in serial
    assert n == n_parallel == 301 and n_again == 1  # only the unreadable file is tried again


def test_edge_cases_empty_table_and_documents_without_text():
    def no_model():
        raise AssertionError("nothing to score")

    empty = mine_table(MODEL_INPUT_SCHEMA.empty_table(), {"cache_path": None, "progress": False}, no_model, "k")
    assert empty.table.num_rows == 0 and empty.counts["mined"] == 0
    assert TextIndex([None, "", "!!"]).search(["red dress"], k=5) == [[]]
