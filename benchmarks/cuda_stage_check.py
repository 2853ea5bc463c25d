"""Check the training and inference paths on CUDA in bf16 with builtin:tiny: one stage through the real
launcher (`accelerate launch`, 1 GPU, bf16), then the saved model scored in bf16 against fp32.

Needs torch, transformers, peft, accelerate, datasets, pyyaml; no kedro, no mlflow. Prints its figures.
`python benchmarks/cuda_stage_check.py [--devices N] [--finetune lora|full|qlora]`
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from lychee_pipeline.reranker import Reranker
from lychee_pipeline.training.launch import run_stage
from lychee_pipeline.training.synthetic import write_colour_item_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--finetune", default="lora")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    work = Path(tempfile.mkdtemp(prefix="cuda_check_"))
    data = write_colour_item_table(work / "data")
    training = dict(loss="pointwise", temperature=0.05, group_size=8, per_device_batch_size=2,
                    gradient_accumulation_steps=1, learning_rate=2e-3, weight_decay=0.0, warmup_ratio=0.0,
                    scheduler="constant", max_grad_norm=1.0, epochs=1, max_steps=args.steps, seed=1,
                    max_length=512, min_pixels=3136, max_pixels=50176, resolution_schedule=[],
                    checkpoint_every=6, keep_last=2, resume=False, log_every=3,
                    launch=dict(strategy="ddp", mixed_precision="auto", num_machines=1, machine_rank=0,
                                main_process_ip=None, main_process_port=None, timeout_s=900,
                                process_group_timeout_s=120, threads_per_process=1))
    spec = {"stage": f"cuda_check_{args.devices}gpu", "data_path": str(data), "output_dir": str(work / "stage"),
            "model": {"name_or_path": "builtin:tiny", "finetune": args.finetune, "tiny_cache_dir": str(work / "tiny")},
            "training": training}
    started = time.perf_counter()
    result = run_stage(work / "stage", spec, args.devices, "cuda")
    print(json.dumps({k: result[k] for k in ("stage", "devices", "device_type", "steps", "pairs_per_s",
                                             "peak_mem_gib", "final_loss", "replica_max_diff")}))
    losses = [x for _, x in result["losses"]]
    print(f"stage wall {time.perf_counter() - started:.1f}s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    saved = result["adapter_dir"]
    pairs = [({"text": "red dress"}, {"text": "a red dress", "image": str(work / "data/red.png")}),
             ({"text": "red dress"}, {"text": "a blue bag"}),
             ({"text": "green shoes"}, {"image": str(work / "data/green.png")})]
    bf16 = Reranker.from_pretrained(saved, device="cuda", dtype="bf16").score_pairs(pairs)
    fp32 = Reranker.from_pretrained(saved, device="cuda", dtype="fp32").score_pairs(pairs)
    print("scores bf16", [round(s, 4) for s in bf16], "fp32", [round(s, 4) for s in fp32],
          "max diff", round(max(abs(a - b) for a, b in zip(bf16, fp32)), 4))


if __name__ == "__main__":
    main()
