"""Scoring the demo catalogue's pairs with builtin:tiny on this machine: the scoring loop as it was before
issue 17 (whole chunk prepared with images decoded, sorted, encoded and scored one batch at a time, written
out in tests/reranker/test_scoring_pipeline.py) against ``Reranker.score_pairs`` now (host thread ahead).

    PYTHONPATH=src python benchmarks/demo_scoring.py [records, default 400]

The demo catalogue (320 products, 2400 records, small PNGs) is generated in a temporary folder; the first
``records`` records give 8 pairs each. One model thread, as on the 2-vCPU development machine.
"""
import json
import sys
import tempfile
import time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reranker"))
from lychee_pipeline.data.catalogue import ensure_demo_data, RECORDS_FILE
from lychee_pipeline.reranker import Reranker
from test_scoring_pipeline import serial_scores
torch.set_num_threads(1)
out = Path(tempfile.mkdtemp()) / "demo"
ensure_demo_data({"out_dir": str(out)})
lines = [json.loads(line) for line in open(out / RECORDS_FILE)][: int(sys.argv[1]) if len(sys.argv) > 1 else 400]
def item(x):
    if isinstance(x, str): return {"text": x, "image": None}
    img = x.get("image")
    return {"text": x.get("text"), "image": str(out / img) if img else None}
pairs = []
for r in lines:
    q = item(r["query"])
    for d in [r["pos_doc"]] if isinstance(r.get("pos_doc"), dict) else r.get("pos_doc", []):
        pairs.append((q, item(d)))
    for d in r.get("neg_docs", []):
        pairs.append((q, item(d)))
print(len(lines), "records", len(pairs), "pairs", flush=True)
scorer = Reranker.from_pretrained("builtin:tiny", device="cpu", batch_size=16, tiny_cache_dir=str(out.parent / "tiny"))
scorer.score_pairs(pairs[:16])
t = time.perf_counter(); before = serial_scores(scorer, pairs); tb = time.perf_counter() - t
t = time.perf_counter(); after = scorer.score_pairs(pairs); ta = time.perf_counter() - t
print(f"before (serial loop): {tb:.1f} s ({len(pairs)/tb:.1f} pairs/s); after (score_pairs, host thread): {ta:.1f} s ({len(pairs)/ta:.1f} pairs/s); same scores: {before == after}")
