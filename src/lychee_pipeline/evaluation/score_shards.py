"""Sharded test-set scoring: the entry point each `accelerate launch` process runs (Kedro-free).

`python -m lychee_pipeline.evaluation.score_shards --spec <scoring folder>/spec.json`, started as a runtime
`LaunchJob` (`evaluation.scoring.launch_scoring`) on `gpus` GPUs or N CPU processes (gloo).

The spec is a `ScoringJobSpec`: its jobs, one per model (`ScoringJob`: name, name_or_path, adapter, options,
pairs_path, scores_path), and the launch settings. For each job every process loads the model on its device, scores its shard of the pairs
(pair ``i`` goes to rank ``i % world_size``, so every rank gets the same mix of short and long pairs) with
the length-sorted batched scorer ``Reranker.score_pairs``, and rank 0 gathers the shards, puts the scores
back in the original pair order and writes them once (``scores_path``, Parquet, one ``score`` column).
Rank 0 then writes ``result.json`` in the spec's ``output_dir``: per job the pair count, the processes, the
wall time (model load + scoring + gather) and the scoring rate.

The same functions run in the Kedro process for a single-process scoring (:func:`score_pairs_in_slices`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from lychee_pipeline.runtime.heartbeat import Heartbeat
from lychee_pipeline.runtime.settings import LaunchParams

log = logging.getLogger("lychee_pipeline.evaluation.score_shards")

SLICE = 1024  # pairs handed to score_pairs at once: large enough for its length sorting to pay off
PROGRESS_EVERY_S = 20.0  # a progress line this often while scoring, when the output is a file
PAIR_SCHEMA = pa.schema([("query_text", pa.string()), ("query_image", pa.string()),
                         ("doc_text", pa.string()), ("doc_image", pa.string()), ("instruction", pa.string())])


class ScoringJob(BaseModel):
    """One model to score on every process: its pairs file, and where rank 0 writes the scores."""

    model_config = ConfigDict(extra="forbid")

    name: str
    name_or_path: str
    adapter: str | None = None  # a stage's saved folder, which names its own base model
    options: dict[str, Any] = {}  # keyword arguments of Reranker.from_pretrained (the device is the rank's)
    pairs_path: str
    scores_path: str


class ScoringJobSpec(BaseModel):
    """What a scoring launch's processes read from their spec file."""

    model_config = ConfigDict(extra="forbid")

    stage: str  # the launch's name in logs and progress
    output_dir: str  # where rank 0 writes result.json (the launch's folder)
    jobs: list[ScoringJob]
    launch: LaunchParams = LaunchParams(mixed_precision="no")  # the model's own dtype decides; no autocast

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=1)

    @classmethod
    def read(cls, path: Path | str) -> ScoringJobSpec:
        return cls.model_validate(json.loads(Path(path).read_text()))


def write_pairs(pairs: Sequence[Sequence[Any]], path: Path) -> Path:
    """The ``(query item, doc item[, instruction])`` pairs as a Parquet file the scoring processes read
    (atomic write); a missing or None instruction is derived from the pair by the reranker."""
    table = pa.Table.from_pydict({
        "query_text": [p[0].get("text") for p in pairs], "query_image": [p[0].get("image") for p in pairs],
        "doc_text": [p[1].get("text") for p in pairs], "doc_image": [p[1].get("image") for p in pairs],
        "instruction": [p[2] if len(p) > 2 else None for p in pairs],
    }, schema=PAIR_SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def read_pairs(path: Path | str) -> list[tuple[dict[str, Any], dict[str, Any], str | None]]:
    cols = pq.read_table(path).to_pydict()
    return [({"text": qt, "image": qi}, {"text": dt, "image": di}, instruction)
            for qt, qi, dt, di, instruction in zip(cols["query_text"], cols["query_image"], cols["doc_text"],
                                                   cols["doc_image"], cols["instruction"])]


def write_scores(scores: Sequence[float], path: Path | str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.table({"score": pa.array([float(s) for s in scores], pa.float64())}), tmp)
    os.replace(tmp, path)


def read_scores(path: Path | str) -> list[float]:
    return pq.read_table(path).column("score").to_pylist()


def score_pairs_in_slices(reranker: Any, pairs: Sequence[Any], progress: str | None = None,
                          on_slice: Callable[[int], None] | None = None) -> list[float]:
    """``reranker.score_pairs`` over large slices (its length sorting works inside each slice).

    With ``progress``: a bar on a terminal; when the output is a file, a log line every
    ``PROGRESS_EVERY_S`` seconds instead (and at the end).
    """
    from tqdm.auto import tqdm

    values: list[float] = []
    starts = range(0, len(pairs), SLICE)
    bar = tqdm(starts, desc=progress or "scoring", unit="slice", disable=None if progress else True)
    started = last = time.monotonic()
    for start in bar:
        values.extend(reranker.score_pairs(pairs[start : start + SLICE]))
        if on_slice is not None:
            on_slice(len(values))
        now = time.monotonic()
        if progress and bar.disable and (now - last >= PROGRESS_EVERY_S or len(values) == len(pairs)):
            elapsed = now - started
            log.info("%s: %d/%d pairs (%.0f%%) in %.0f s, ETA %.0f s", progress, len(values), len(pairs),
                     100 * len(values) / max(1, len(pairs)), elapsed,
                     elapsed / max(1, len(values)) * (len(pairs) - len(values)))
            last = now
    if len(values) != len(pairs):
        raise RuntimeError(f"{len(values)} scores for {len(pairs)} pairs")
    return values


def shard(n: int, rank: int, world: int) -> range:
    """The pair indices of one rank: every ``world``-th pair from ``rank``."""
    return range(rank, n, world)


def _load(job: ScoringJob, device: str) -> Any:
    from lychee_pipeline.reranker import Reranker

    options = {**job.options, "device": device}
    if job.adapter:  # a stage's saved folder names its own base model
        return Reranker.from_pretrained(job.adapter, **options)
    return Reranker.from_pretrained(job.name_or_path, **options)


def run_job(job: ScoringJob, state: Any, beat: Callable[[int, str], None] = lambda step, phase: None
            ) -> dict[str, Any]:
    """Score one model's pairs on this process's shard; rank 0 gathers and writes the scores.

    ``beat(pairs scored, phase)`` after every slice: the launcher's watchdog stops a launch whose ranks are
    silent for ``training.launch.watchdog_s``, so a scoring launch of hours must show its progress too.
    """
    import torch.distributed as dist

    distributed = state.num_processes > 1
    if distributed:
        dist.barrier()
    started = time.perf_counter()
    pairs = read_pairs(job.pairs_path)
    mine = shard(len(pairs), state.process_index, state.num_processes)
    reranker = _load(job, str(state.device))
    loaded = time.perf_counter()
    # loaded: from here on the watchdog's limit is watchdog_s between slices. The launcher shows the progress of
    # all shards together (runtime/progress.py), so the ranks print none of their own.
    beat(0, "step", total=len(pairs), task=job.name)
    scores = score_pairs_in_slices(reranker, [pairs[i] for i in mine], on_slice=lambda done: beat(done, "step"))
    scored = time.perf_counter()
    log.info("%s: shard of %d/%d pairs scored in %.2f s", job.name, len(mine), len(pairs), scored - loaded)
    del reranker
    shards: list[Any] = [None] * state.num_processes
    if distributed:
        dist.all_gather_object(shards, (state.process_index, scores, scored - loaded))
    else:
        shards = [(0, scores, scored - loaded)]
    figures: dict[str, Any] = {}
    if state.is_main_process:
        ordered = [0.0] * len(pairs)
        for rank, values, _ in shards:
            for i, value in zip(shard(len(pairs), rank, state.num_processes), values, strict=True):
                ordered[i] = value
        write_scores(ordered, job.scores_path)
        wall = time.perf_counter() - started
        scoring_s = max(s for _, _, s in shards)  # the slowest shard decides when the scores are all there
        figures = {
            "name": job.name, "pairs": len(pairs), "processes": state.num_processes,
            "device": str(state.device).split(":")[0], "seconds": wall, "load_seconds": loaded - started,
            "scoring_seconds": scoring_s, "pairs_per_s": len(pairs) / scoring_s if scoring_s > 0 else None,
            "rank_scoring_seconds": [s for _, _, s in sorted(shards, key=lambda t: t[0])],
            "scores_path": job.scores_path,
        }
        log.info("%s: %d pairs on %d process(es) in %.2f s (%.1f pairs/s)", job.name, len(pairs),
                 state.num_processes, wall, figures["pairs_per_s"] or 0.0)
    return figures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    spec = ScoringJobSpec.read(args.spec)

    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # without CUDA the launcher sets ACCELERATE_USE_CPU: N CPU processes over gloo (as Accelerator does)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    # the launcher stamps each relayed line with its own time, as it does for the training ranks
    logging.basicConfig(level=logging.INFO, format=f"[rank {state.process_index}] %(message)s")
    if state.process_index > 0:  # every rank loads the same model: its set-up lines once (rank 0), not N times
        logging.getLogger("lychee_pipeline.reranker").setLevel(logging.WARNING)
    import torch

    torch.manual_seed(0)
    beat = Heartbeat(spec.output_dir, state.process_index, str(state.distributed_type),  # the launcher's watchdog
                     unit="pair", sharded=True)
    beat(0, "started")
    results = [run_job(job, state, beat) for job in spec.jobs]
    if state.is_main_process:
        out = Path(spec.output_dir) / "result.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stage": spec.stage, "processes": state.num_processes, "jobs": results},
                                  indent=1))
        os.replace(tmp, out)
    state.wait_for_everyone()
    beat(0, "leaving")  # past the final barrier
    if state.num_processes > 1:
        # Every rank is past the last collective and rank 0 has written the result. Leave without running
        # gloo's C++ teardown: when one rank tears down while another still does, it can abort the process
        # ("terminate called without an active exception", SIGABRT, seen once in CI on 2 CPU processes) and
        # fail a finished scoring launch. Nothing is left to flush but the log streams.
        beat(0, "done")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
