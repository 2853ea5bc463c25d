"""Smoke run trained with random negatives only against mined + random, on the same demo data and test split.

Runs the `data` pipeline once in a fresh project copy, removes every negative from the train split and the
smoke subset (the test split keeps its negatives: they are the evaluation's candidates), then runs
`smoke` from `mine_negatives` twice: A with 7 random negatives per query, B with 4 mined + 3 random.
Prints MRR@10 of both fine-tuned models and a paired sign-flip test over the test queries.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/mining_smoke_compare.py /tmp/mining_compare
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

COMMON = {"smoke_enabled": True, "relative_margin": 1.5, "rescore_top": 8, "rank_window": [1, 8], "progress": False,
          "reranker": {"batch_size": 32, "device": "cpu", "max_pixels": 12544}}
RUNS = {"A_random7": {**COMMON, "n_mined": 0, "n_random": 7},
        "B_mined4_random3": {**COMMON, "n_mined": 4, "n_random": 3}}


def strip_negatives(path: Path) -> None:
    table = pq.read_table(path)
    rows = table.to_pylist()
    for row in rows:
        row["negatives"] = []
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def reciprocal_ranks(scores: pd.DataFrame) -> pd.Series:
    out = {}
    for query, group in scores[scores.model != "base"].groupby("query_id"):
        group = group.sort_values(["score", "position"], ascending=[False, True])
        hits = np.flatnonzero(group["label"].to_numpy() > 0)
        out[query] = 1.0 / (hits[0] + 1) if len(hits) and hits[0] < 10 else 0.0
    return pd.Series(out)


def main() -> None:
    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from project_runs import make_project_copy, run_kedro

    base = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mining_compare")
    first = base / "A_random7"
    make_project_copy(first)
    run_kedro(first, "data")
    for name in ("train.parquet", "smoke_train.parquet"):
        strip_negatives(first / "data/05_model_input" / name)
    results = {}
    for name, mining in RUNS.items():
        root = base / name
        if root != first:
            shutil.copytree(first, root, ignore=shutil.ignore_patterns("mlflow.db", "06_models", "04_feature"))
        t0 = time.time()
        previous = os.getcwd()
        os.chdir(root)
        try:
            bootstrap_project(root)
            with KedroSession.create(project_path=root, runtime_params={"mining": mining}) as session:
                session.run(pipeline_name="smoke", from_nodes=["mining.mine_negatives", "training.plan_smoke_training"])
        finally:
            os.chdir(previous)
            while mlflow.active_run() is not None:
                mlflow.end_run()
        metrics = json.loads((root / "data/08_reporting/evaluation_mlflow_metrics.json").read_text())
        counts = json.loads((root / "data/05_model_input/mining_counts.json").read_text())
        results[name] = {"seconds": round(time.time() - t0), "mrr_base": metrics["test.mrr_at_10.base"],
                         "mrr_finetuned": metrics["test.mrr_at_10.finetuned"],
                         "mined": counts.get("mined"), "random": counts.get("random")}
        print(name, json.dumps(results[name]), flush=True)
    a, b = (reciprocal_ranks(pd.read_parquet(base / n / "data/07_model_output/test_scores.parquet")) for n in RUNS)
    a, b = a.align(b)
    diff = (b - a).to_numpy()
    rng = np.random.default_rng(0)
    null = (rng.choice([-1, 1], size=(10_000, len(diff))) * diff).mean(axis=1)
    boot = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(10_000)]
    print(f"MRR@10 B - A = {diff.mean():+.4f} over {len(diff)} test queries; paired sign-flip p = "
          f"{(np.abs(null) >= abs(diff.mean())).mean():.3f}; 95% bootstrap interval {np.percentile(boot, [2.5, 97.5]).round(4)}")


if __name__ == "__main__":
    main()
