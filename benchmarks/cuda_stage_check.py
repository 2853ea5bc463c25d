"""Check the training and inference paths on CUDA in bf16 with builtin:tiny: one stage through the real
launcher (`accelerate launch`, 1 GPU, bf16), then the saved model scored in bf16 against fp32, and a scoring
call stopped by a broken image in its last batch (the next call must score as before).

Needs torch, transformers, peft, accelerate, datasets, pyyaml, pydantic (the stage contract); no kedro, no mlflow.
Prints its figures.
`python benchmarks/cuda_stage_check.py [--devices N] [--finetune lora|full|qlora] [--strategy ddp|fsdp2|zero2|zero3]
[--resume]` (--resume: a second launch resumes from the step-6 checkpoint and must repeat the losses after it)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from lychee_pipeline.reranker import Reranker
from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.training.stage_launch import run_stage
from lychee_pipeline.training.stage import StageResult, StageSpec
from lychee_pipeline.training.synthetic import write_colour_item_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--finetune", default="lora")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    work = Path(tempfile.mkdtemp(prefix="cuda_check_"))
    data = write_colour_item_table(work / "data")
    # the library's defaults for everything not named here
    training = TrainingParams(loss="pointwise", group_size=8, per_device_batch_size=2, learning_rate=2e-3,
                              warmup_ratio=0.0, scheduler="constant", max_steps=args.steps, seed=1, max_length=512,
                              max_pixels=50176, checkpoint_every=6, keep_last=2, reuse_finished=False, log_every=3,
                              launch={"strategy": args.strategy, "timeout_s": 900, "process_group_timeout_s": 120})
    template = None
    if args.strategy != "ddp":
        import yaml

        template = yaml.safe_load((Path(__file__).parent.parent / "conf/base/accelerate" / f"{args.strategy}.yaml").read_text())
    spec = StageSpec(stage=f"cuda_check_{args.devices}gpu_{args.strategy}", data_path=str(data),
                     output_dir=str(work / "stage"), training=training,
                     model=ModelConfig(name_or_path="builtin:tiny", finetune=args.finetune,
                                       tiny_cache_dir=str(work / "tiny")))
    started = time.perf_counter()
    result = StageResult.model_validate(run_stage(work / "stage", spec, args.devices, "cuda", template))
    log_text = (work / "stage" / "launch.log").read_text()
    print("checkpoint files:", sorted(str(p.relative_to(work / "stage")) for p in (work / "stage/checkpoints").rglob("*"))[:12])
    beats = json.loads((work / "stage" / "heartbeat" / "rank0.json").read_text())
    print("distributed type:", beats.get("distributed_type"), "| FSDP in the log:", "FSDP" in log_text)
    if args.resume:
        first = result.losses
        import shutil

        shutil.rmtree(work / "stage" / "adapter")
        spec = spec.model_copy(update={"training": training.model_copy(update={"resume": True})})
        (work / "stage" / "result.json").unlink()
        for ckpt in sorted((work / "stage/checkpoints").glob("checkpoint-*")):
            if ckpt.name != "checkpoint-6":
                shutil.rmtree(ckpt)
        again = StageResult.model_validate(run_stage(work / "stage", spec, args.devices, "cuda", template))
        pairs = [(a, b) for a, b in zip(first, again.losses) if a[0] > 6]
        print("resume from checkpoint-6: steps", [a[0] for a, _ in pairs], "max loss diff",
              max(abs(a[1] - b[1]) for a, b in pairs) if pairs else None)
        result = again
    print(json.dumps(result.model_dump(include={"stage", "devices", "device_type", "steps", "pairs_per_s",
                                                "peak_mem_gib", "final_loss", "replica_max_diff"})))
    losses = [x for _, x in result.losses]
    print(f"stage wall {time.perf_counter() - started:.1f}s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    saved = result.adapter_dir
    pairs = [({"text": "red dress"}, {"text": "a red dress", "image": str(work / "data/red.png")}),
             ({"text": "red dress"}, {"text": "a blue bag"}),
             ({"text": "green shoes"}, {"image": str(work / "data/green.png")})]
    bf16 = Reranker.from_pretrained(saved, device="cuda", dtype="bf16").score_pairs(pairs)
    fp32 = Reranker.from_pretrained(saved, device="cuda", dtype="fp32").score_pairs(pairs)
    print("scores bf16", [round(s, 4) for s in bf16], "fp32", [round(s, 4) for s in fp32],
          "max diff", round(max(abs(a - b) for a, b in zip(bf16, fp32)), 4))

    # a JPEG cut short in the last of several batches: its error reaches the caller after earlier batches were
    # launched (inputs copied on the scorer's own stream), and the same scorer's next call scores as before
    from PIL import Image

    from lychee_pipeline.reranker.collate import BrokenImageError

    whole, cut = work / "data/whole.jpg", work / "data/cut.jpg"
    Image.effect_noise((800, 800), 60).convert("RGB").save(whole, quality=90)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    many = [(q, {**d, "image": str(whole)} if "image" in d else d) for q, d in pairs * 12]
    scorer = Reranker.from_pretrained(saved, device="cuda", dtype="bf16", batch_size=4)
    clean = scorer.score_pairs(many)
    try:
        scorer.score_pairs(many + [({"text": "red dress"}, {"text": "a red dress", "image": str(cut)})])
        stopped = "no error raised"
    except BrokenImageError as exc:
        stopped = f"BrokenImageError ({exc})"
    print(f"{len(many) + 1} pairs, the last one's JPEG cut short: {stopped}; the next call's {len(many)} scores "
          f"equal the first call's: {scorer.score_pairs(many) == clean}")


if __name__ == "__main__":
    main()
