"""Hard-negative mining for image-and-text training data (Kedro-free).

For every training record: candidates from the first stage (BM25 over document text, pHash neighbours of
the query's and the positives' images) over the documents of the given table, fused and cut to
``rescore_top``; the reranker scores them (and the positives, and the random draws) through
``Reranker.score_pairs``, with a score cache; candidates are ranked by that score and taken from the rank
window, except likely false negatives: a score above ``relative_margin`` x the positive's score, the same
text as a positive, or a near-identical image (pHash distance and mean colour) to a positive's.

The output keeps the model-input schema: the user's negatives first, then ``n_mined`` mined ones
(``hard: true``) and ``n_random`` random ones (``hard: false``); each added negative's ``meta`` JSON gets
``"mining": {"source": "mined" | "random", "score": p(yes), "rank": r}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

from .cache import MiningCache, file_stamp, pair_key
from .first_stage import ImageIndex, TextIndex, fuse, hamming, image_signature, normalize_text
from .params import MiningParams

log = logging.getLogger(__name__)

LOG_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string()),
        pa.field("doc_id", pa.string()),
        pa.field("source", pa.string()),  # mined | random
        pa.field("via", pa.string()),  # bm25 | image | bm25+image | random
        pa.field("rank", pa.int32()),  # by the reranker's score among the rescored candidates (1 = best)
        pa.field("score", pa.float32()),
        pa.field("kept", pa.bool_()),
        pa.field("reason", pa.string()),  # why not kept
    ]
)


@dataclass
class MiningResult:
    table: pa.Table
    counts: dict[str, Any]
    log_table: pa.Table
    scores: dict[str, list[float]] = field(default_factory=dict)  # positive / mined / random / candidate


@dataclass
class _Doc:
    doc_id: str
    text: str | None
    image: str | None
    meta: str | None


class _Pool:
    """The unique documents (by doc_id) of a table's positives and negatives."""

    def __init__(self, table: pa.Table):
        self.index: dict[str, int] = {}
        self.docs: list[_Doc] = []
        for batch in table.select(["positives", "negatives"]).to_batches(max_chunksize=20_000):
            for column in ("positives", "negatives"):
                for docs in batch.column(column).to_pylist():
                    for d in docs or ():
                        if d["doc_id"] not in self.index:
                            self.index[d["doc_id"]] = len(self.docs)
                            self.docs.append(_Doc(d["doc_id"], d.get("text"), d.get("image"), d.get("meta")))
        self.norm_text = [normalize_text(d.text) for d in self.docs]


def _rng(seed: int, record_id: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.blake2b(f"{seed}:{record_id}".encode(), digest_size=8).digest(), "big"))


# reranker options that change how fast scores come, never the scores (a cached score stays valid across them)
SPEED_ONLY_OPTIONS = ("batch_size", "device", "tiny_cache_dir", "prefix_reuse", "vision_cache_gib")


def model_key(model: str, adapter: str | None, reranker: Mapping[str, Any], instruction: str | None) -> str:
    """What the cached scores depend on: the model (and, for a folder, its config and weights' stamps)."""
    stamps = []
    for folder in (model, adapter):
        if folder and Path(folder).is_dir():
            stamps += [f"{p.name}={file_stamp(str(p))}" for p in sorted(Path(folder).iterdir()) if p.is_file()]
    budget = {k: v for k, v in sorted(reranker.items()) if k not in SPEED_ONLY_OPTIONS}
    return json.dumps([model, adapter, budget, instruction, stamps], sort_keys=True, default=str)


def _signature_chunk(paths: Sequence[str], hash_size: int) -> tuple[dict, dict[str, str]]:
    """Signatures of some paths, and why the others failed (runs in a worker process)."""
    done, failed = {}, {}
    for path in paths:
        try:
            done[path] = image_signature(path, hash_size)
        except Exception as exc:  # noqa: BLE001 - a doc image that cannot be hashed is only not an image candidate
            failed[path] = f"{type(exc).__name__}: {exc}"
    return done, failed


def _signatures(paths: Sequence[str], cache: MiningCache, hash_size: int, progress: bool, workers: int = 1):
    """pHash and mean colour of every path (cached; unreadable files are left out)."""
    unique = sorted(set(p for p in paths if p))
    found = cache.get_images(unique, hash_size)
    missing = [p for p in unique if p not in found]
    if missing:
        from lychee_pipeline.runtime.progress import CountedProgress

        chunks = [missing[i : i + 256] for i in range(0, len(missing), 256)]
        with CountedProgress("mining: image hashes", len(missing), "image", enabled=progress) as bar:
            if workers > 1 and len(chunks) > 1:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                    results = pool.map(_signature_chunk, chunks, [hash_size] * len(chunks))
                    for done, failed in results:
                        _keep_signatures(done, failed, cache, hash_size, found, bar)
            else:
                for chunk in chunks:
                    _keep_signatures(*_signature_chunk(chunk, hash_size), cache, hash_size, found, bar)
    return found, len(missing)


def _keep_signatures(done, failed, cache: MiningCache, hash_size: int, found: dict, bar) -> None:
    for path, reason in failed.items():
        log.warning("mining: no image hash for %s: %s", path, reason)
    cache.put_images(done, hash_size)  # kept as they come: an interrupted first run resumes from here
    found.update(done)
    bar.update(len(done) + len(failed))


def _near_image(a, b, params: MiningParams) -> int | None:
    """The pHash distance when two signatures are near-identical (else None)."""
    if a is None or b is None:
        return None
    dist = int(hamming(np.uint64(a[0]), np.uint64(b[0])))
    colour = max(abs(x - y) for x, y in zip(a[1], b[1]))
    return dist if dist <= params.near_duplicate_distance and colour <= params.near_duplicate_colour else None


def _false_negative(doc: _Doc, score: float | None, positives: list[dict], pos_sigs: list, sig, pos_floor: float | None,
                    params: MiningParams, norm_text: str) -> str | None:
    """Why a candidate is a likely false negative (None: it is not)."""
    if norm_text and norm_text in {normalize_text(p.get("text")) for p in positives}:
        return "same text as a positive"
    for ps in pos_sigs:
        dist = _near_image(sig, ps, params)
        if dist is not None:
            return f"near-identical image to a positive (hash distance {dist})"
    if score is not None and pos_floor is not None and score > params.relative_margin * pos_floor:
        return f"score {score:.4f} > {params.relative_margin} x positive {pos_floor:.4f}"
    return None


def select_negatives(
    ranked: Sequence[tuple[int, float]], window: tuple[int, int], n: int, false_negative: Callable[[int, float], str | None]
) -> list[tuple[int, int, float, bool, str | None]]:
    """Go through candidates best first ``(doc, score)``; keep up to ``n`` from ranks ``window`` (1-based,
    inclusive) that are not false negatives. Returns ``(doc, rank, score, kept, reason)`` for each."""
    a, b = window
    out = []
    kept = 0
    for rank, (doc, score) in enumerate(ranked, start=1):
        reason = false_negative(doc, score)
        if reason is None:
            if rank < a:
                reason = f"above the rank window (rank {rank} < {a})"
            elif rank > b:
                reason = f"below the rank window (rank {rank} > {b})"
            elif kept >= n:
                reason = "enough mined negatives"
        out.append((doc, rank, score, reason is None, reason))
        kept += reason is None
    return out


def _draw_random(pool: _Pool, sigs: dict, p: MiningParams, rng: random.Random, k: int, chosen: set[int],
                 pos_texts: set[str], pos_sigs: list) -> list[int]:
    """Up to ``k`` random documents not in ``chosen`` (which grows), never a positive's text or image copy."""
    out: list[int] = []
    tried = 0
    while len(out) < k and tried < 20 * k and len(pool.docs) > len(chosen):
        tried += 1
        d = rng.randrange(len(pool.docs))
        if d in chosen or pool.norm_text[d] in pos_texts:
            continue
        if any(_near_image(sigs.get(pool.docs[d].image), s, p) is not None for s in pos_sigs):
            continue
        chosen.add(d)
        out.append(d)
    return out


def _with_mining_meta(meta: str | None, mark: dict[str, Any]) -> str:
    try:
        base = json.loads(meta) if meta else {}
    except ValueError:
        base = {"original_meta": meta}
    if not isinstance(base, dict):
        base = {"original_meta": base}
    return json.dumps({**base, "mining": mark}, ensure_ascii=False, sort_keys=True)


class _Scorer:
    """Scores through the cache; the reranker is loaded only when a pair is missing."""

    def __init__(self, factory: Callable[[], Any], cache: MiningCache, key: str, instruction: str | None, progress: bool):
        self.factory, self.cache, self.key, self.instruction, self.progress = factory, cache, key, instruction, progress
        self.reranker = None
        self.chunk = 1024
        from tqdm.auto import tqdm

        # no total known: a bar on a terminal only (the records' progress below has the plain lines of a file)
        self.bar = tqdm(desc="mining: rescoring pairs", unit="pair", disable=None if progress else True,
                        mininterval=10)
        self.pairs = self.scored = self.hits = 0  # pairs asked, scored by the model (unique), found in the cache
        self.seconds = 0.0

    def __call__(self, pairs: Sequence[tuple[dict, dict]]) -> list[float]:
        keys = [pair_key(self.key, q, d) for q, d in pairs]
        found = self.cache.get_scores(list(dict.fromkeys(keys)))
        todo = list(dict.fromkeys(k for k in keys if k not in found))
        self.pairs += len(keys)
        self.hits += sum(1 for k in keys if k in found)
        if todo:
            if self.reranker is None:
                self.reranker = self.factory()
            first = {k: i for i, k in reversed(list(enumerate(keys)))}
            batch = [pairs[first[k]] + ((self.instruction,) if self.instruction else ()) for k in todo]
            for start in range(0, len(todo), self.chunk):  # cached chunk by chunk: an interrupted run resumes
                t0 = time.perf_counter()
                scores = self.reranker.score_pairs(batch[start : start + self.chunk])
                self.seconds += time.perf_counter() - t0
                new = dict(zip(todo[start : start + self.chunk], (float(x) for x in scores)))
                self.cache.put_scores(new.items())
                found.update(new)
                self.scored += len(new)
                self.bar.update(len(new))
        return [found[k] for k in keys]


@dataclass
class _Tally:
    """What a mining run counts and keeps across batches: counts, scores by kind, log rows of this batch."""

    n: dict[str, int]
    scores: dict[str, list[float]]
    log_rows: list[dict[str, Any]]


def _first_stage(rows: list[dict], text_index: TextIndex, image_index: ImageIndex, sigs: dict,
                 p: MiningParams) -> tuple[list, list]:
    """BM25 hits of each record's query text (the positive's text for an image-only query) and the pHash
    neighbours of its query and positive images."""
    text_queries = [(r["query"] or {}).get("text") or next((d.get("text") for d in r["positives"] if d.get("text")), None)
                    for r in rows]
    bm25 = text_index.search(text_queries, p.bm25_k) if p.bm25_k else [[] for _ in rows]
    image_queries = []
    for r in rows:
        paths = [(r["query"] or {}).get("image")] + [d.get("image") for d in r["positives"]]
        image_queries.append({sigs[x][0] for x in paths if x in sigs})
    near = image_index.search(image_queries, p.image_k) if p.image_k else [[] for _ in rows]
    return bm25, near


def _plan_batch(rows: list[dict], bm25: list, near: list, pool: _Pool, sigs: dict, p: MiningParams,
                n: dict[str, int]) -> tuple[list[tuple], list[tuple[dict, dict]]]:
    """Per record: the fused candidates to rescore and the random draws; and every pair of the batch to score
    (each record's positives, candidates and randoms, from its offset ``first``)."""
    plans = []
    pairs: list[tuple[dict, dict]] = []
    for r, hits_t, hits_i in zip(rows, bm25, near):
        exclude = {d["doc_id"] for d in r["positives"]} | {d["doc_id"] for d in r["negatives"]}
        excluded = {pool.index[x] for x in exclude if x in pool.index}
        rank_t = [d for d, _ in hits_t if d not in excluded]
        rank_i = [d for d, _ in hits_i if d not in excluded]
        cands = fuse([rank_t, rank_i], p.rescore_top) if p.n_mined else []  # n_mined 0: random only
        n["candidates"] += len(set(rank_t) | set(rank_i))
        via = {d: "+".join(x for x, s in (("bm25", rank_t), ("image", rank_i)) if d in s) for d in cands}
        pos_sigs = [sigs.get(d.get("image")) for d in r["positives"]]
        pos_sigs = [s for s in pos_sigs if s is not None]
        pos_texts = {normalize_text(d.get("text")) for d in r["positives"]} - {""}
        rng = _rng(p.seed, r["record_id"])
        chosen = set(cands) | excluded
        randoms = _draw_random(pool, sigs, p, rng, p.n_random, chosen, pos_texts, pos_sigs)
        q = {"text": (r["query"] or {}).get("text"), "image": (r["query"] or {}).get("image")}
        first = len(pairs)
        pairs += [(q, {"text": d.get("text"), "image": d.get("image")}) for d in r["positives"]]
        pairs += [(q, {"text": pool.docs[d].text, "image": pool.docs[d].image}) for d in cands + randoms]
        plans.append((r, cands, randoms, via, pos_sigs, first, rng, chosen, pos_texts))
    return plans, pairs


def _take_negatives(plan: tuple, batch_scores: list[float], pool: _Pool, sigs: dict, p: MiningParams,
                    tally: _Tally) -> tuple[list[dict], int]:
    """A record's negatives after mining (its own, then the kept mined ones, then the random ones), and how
    many mined ones were kept; every candidate's decision goes to the log."""
    r, cands, randoms, via, pos_sigs, first, _, _, _ = plan
    n, scores, log_rows = tally.n, tally.scores, tally.log_rows
    n_pos = len(r["positives"])
    pos_scores = batch_scores[first : first + n_pos]
    cand_scores = batch_scores[first + n_pos : first + n_pos + len(cands)]
    rand_scores = batch_scores[first + n_pos + len(cands) : first + n_pos + len(cands) + len(randoms)]
    scores["positive"] += pos_scores
    scores["candidate"] += cand_scores
    floor = min(pos_scores) if pos_scores else None
    n["rescored_candidates"] += len(cands)
    if not cands:
        n["queries_without_candidates"] += 1
    ranked = sorted(zip(cands, cand_scores), key=lambda t: (-t[1], t[0]))

    def false_negative(d: int, s: float, r=r, pos_sigs=pos_sigs, floor=floor) -> str | None:
        return _false_negative(pool.docs[d], s, r["positives"], pos_sigs, sigs.get(pool.docs[d].image),
                               floor, p, pool.norm_text[d])

    decisions = select_negatives(ranked, p.rank_window, p.n_mined, false_negative)
    negatives = list(r["negatives"])
    mined = 0
    for d, rank, s, kept, reason in decisions:
        doc = pool.docs[d]
        if reason and not reason.startswith(("above", "below", "enough")):
            n["false_negatives"] += 1
            key = "fn_same_text" if reason.startswith("same") else (
                "fn_near_image" if reason.startswith("near") else "fn_margin")
            n[key] += 1
        if kept:
            mined += 1
            scores["mined"].append(s)
            negatives.append({"doc_id": doc.doc_id, "text": doc.text, "image": doc.image, "hard": True,
                              "meta": _with_mining_meta(doc.meta, {"source": "mined", "score": round(s, 6),
                                                                   "rank": rank, "via": via[d]})})
        log_rows.append({"record_id": r["record_id"], "doc_id": doc.doc_id, "source": "mined",
                         "via": via[d], "rank": rank, "score": s, "kept": kept, "reason": reason})
    n["mined"] += mined
    n["queries_short"] += mined < p.n_mined
    for d, s in zip(randoms, rand_scores):
        doc = pool.docs[d]
        scores["random"].append(s)
        negatives.append({"doc_id": doc.doc_id, "text": doc.text, "image": doc.image, "hard": False,
                          "meta": _with_mining_meta(doc.meta, {"source": "random", "score": round(s, 6)})})
        log_rows.append({"record_id": r["record_id"], "doc_id": doc.doc_id, "source": "random",
                         "via": "random", "rank": None, "score": s, "kept": True, "reason": None})
    n["random"] += len(randoms)
    return negatives, mined


def _add_fills(out_rows: list[dict], fills: list[tuple[int, int]], scorer: _Scorer, pool: _Pool,
               tally: _Tally) -> None:
    """Score the random negatives that fill in for mined ones that ran short, and append them."""
    n, scores, log_rows = tally.n, tally.scores, tally.log_rows
    if fills:
        q_of = lambda i: {"text": (out_rows[i]["query"] or {}).get("text"),  # noqa: E731
                          "image": (out_rows[i]["query"] or {}).get("image")}
        fill_scores = scorer([(q_of(i), {"text": pool.docs[d].text, "image": pool.docs[d].image})
                              for i, d in fills])
        for (i, d), s in zip(fills, fill_scores):
            doc = pool.docs[d]
            scores["random"].append(s)
            out_rows[i]["negatives"].append(
                {"doc_id": doc.doc_id, "text": doc.text, "image": doc.image, "hard": False,
                 "meta": _with_mining_meta(doc.meta, {"source": "random", "score": round(s, 6), "fill": True})})
            log_rows.append({"record_id": out_rows[i]["record_id"], "doc_id": doc.doc_id, "source": "random",
                             "via": "random (fill)", "rank": None, "score": s, "kept": True, "reason": None})
        n["random"] += len(fills)
        n["random_fill"] += len(fills)


def mine_table(
    table: pa.Table, params: MiningParams | Mapping[str, Any], reranker_factory: Callable[[], Any], model_id: str
) -> MiningResult:
    """Mine negatives for every record of ``table`` from the documents of ``table`` itself.

    ``reranker_factory()`` returns an object with ``score_pairs(pairs) -> list[float]`` (a
    :class:`~lychee_pipeline.reranker.inference.Reranker`); ``model_id`` keys the score cache.
    """
    p = params if isinstance(params, MiningParams) else MiningParams(**params)
    file_stamp.cache_clear()
    t_start = time.perf_counter()
    counts: dict[str, Any] = {"queries": table.num_rows}
    if table.num_rows == 0:
        return MiningResult(table.cast(MODEL_INPUT_SCHEMA), {**counts, "documents": 0, "mined": 0, "random": 0},
                            LOG_SCHEMA.empty_table(), {})
    pool = _Pool(table)
    counts["documents"] = len(pool.docs)
    from lychee_pipeline.runtime.progress import CountedProgress

    with MiningCache(p.cache_path) as cache, contextlib.ExitStack() as closing:  # the bars stop on an error too
        t0 = time.perf_counter()
        query_images = table.column("query").combine_chunks().field("image").to_pylist() if table.num_rows else []
        sigs, hashed = _signatures([d.image for d in pool.docs] + query_images, cache, p.hash_size, p.progress,
                                   p.image_workers)
        counts["images_hashed"] = hashed
        text_index = TextIndex([d.text for d in pool.docs])
        with_image = [i for i, d in enumerate(pool.docs) if d.image in sigs]
        image_index = ImageIndex(with_image, [sigs[pool.docs[i].image][0] for i in with_image])
        counts["seconds_index"] = round(time.perf_counter() - t0, 3)

        scorer = _Scorer(reranker_factory, cache, model_id, p.instruction, p.progress)
        closing.callback(scorer.bar.close)
        out_batches: list[pa.RecordBatch] = []
        log_batches: list[pa.RecordBatch] = []
        scores: dict[str, list[float]] = {"positive": [], "mined": [], "random": [], "candidate": []}
        n = {"candidates": 0, "rescored_candidates": 0, "false_negatives": 0, "fn_same_text": 0, "fn_near_image": 0,
             "fn_margin": 0, "mined": 0, "random": 0, "random_fill": 0, "queries_short": 0, "queries_without_candidates": 0}
        tally = _Tally(n, scores, [])
        t_first = 0.0
        bar = closing.enter_context(CountedProgress("mining negatives", table.num_rows, "record", enabled=p.progress))
        for start in range(0, table.num_rows, p.batch_queries):
            rows = table.slice(start, p.batch_queries).to_pylist()
            t1 = time.perf_counter()
            bm25, near = _first_stage(rows, text_index, image_index, sigs, p)
            t_first += time.perf_counter() - t1

            plans, pairs = _plan_batch(rows, bm25, near, pool, sigs, p, n)

            batch_scores = scorer(pairs)
            out_rows, fills = [], []
            for plan in plans:
                r, _, _, _, pos_sigs, _, rng, chosen, pos_texts = plan
                negatives, mined = _take_negatives(plan, batch_scores, pool, sigs, p, tally)
                out_rows.append({**r, "negatives": negatives})
                if p.fill_with_random and mined < p.n_mined:  # random ones fill in for mined ones that ran short
                    extra = _draw_random(pool, sigs, p, rng, p.n_mined - mined, chosen, pos_texts, pos_sigs)
                    fills += [(len(out_rows) - 1, d) for d in extra]
            _add_fills(out_rows, fills, scorer, pool, tally)
            out_batches.append(pa.RecordBatch.from_pylist(out_rows, schema=MODEL_INPUT_SCHEMA))
            log_batches.append(pa.RecordBatch.from_pylist(tally.log_rows, schema=LOG_SCHEMA))  # Arrow per batch: compact
            tally.log_rows = []
            bar.update(len(rows))

    counts.update(n)
    counts.update({
        "pairs": scorer.pairs,
        "pairs_scored": scorer.scored,
        "pairs_from_cache": scorer.hits,
        "seconds_first_stage": round(t_first, 3),
        "seconds_rescoring": round(scorer.seconds, 3),
        "rescoring_pairs_per_s": round(scorer.scored / scorer.seconds, 2) if scorer.seconds else None,
        "seconds_total": round(time.perf_counter() - t_start, 3),
    })
    for name in ("positive", "mined", "random"):
        if scores[name]:
            counts[f"mean_score_{name}"] = round(float(np.mean(scores[name])), 6)
    table_out = pa.Table.from_batches(out_batches, schema=MODEL_INPUT_SCHEMA) if out_batches else table.cast(MODEL_INPUT_SCHEMA)
    log.info("mining: %d queries over %d documents: %d candidates, %d rescored (%d from the cache), %d false "
             "negatives filtered, %d mined and %d random negatives kept (%d queries short of n_mined)",
             counts["queries"], counts["documents"], n["candidates"], n["rescored_candidates"], scorer.hits,
             n["false_negatives"], n["mined"], n["random"], n["queries_short"])
    return MiningResult(table_out, counts, pa.Table.from_batches(log_batches, schema=LOG_SCHEMA), scores)


def score_histogram(scores: Mapping[str, Sequence[float]]):
    """A histogram of the base model's scores of positives, mined and random negatives (matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    values_all = [v for name in ("positive", "mined", "random") for v in scores.get(name) or []]
    lo, hi = (min(values_all), max(values_all)) if values_all else (0.0, 1.0)
    pad = max((hi - lo) * 0.02, 1e-4)
    bins = np.linspace(max(lo - pad, 0.0), min(hi + pad, 1.0), 41)  # the scores' own range: an untrained model's are all near 0.5
    for name, colour in (("positive", "tab:green"), ("mined", "tab:red"), ("random", "tab:blue")):
        values = list(scores.get(name) or [])
        if values:
            ax.hist(values, bins=bins, alpha=0.5, color=colour, density=True,
                    label=f"{name} (n={len(values)}, mean {np.mean(values):.3f})")
    if not any(scores.get(name) for name in ("positive", "mined", "random")):
        # not an empty chart with axes that look like a result: a page that says why there is none
        ax.set_axis_off()
        ax.text(0.5, 0.5, "Mining was off in this run (mining.enabled / mining.smoke_enabled):\n"
                "no negatives were mined, so there are no scores to show.", ha="center", va="center",
                transform=ax.transAxes, wrap=True)
        fig.tight_layout()
        return fig
    ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("base reranker p(yes)")
    ax.set_ylabel("density")
    ax.set_title("Mining: scores of positives, mined and random negatives")
    fig.tight_layout()
    return fig
