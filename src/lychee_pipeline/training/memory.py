"""Sizing decisions a stage takes at start-up: how many decoder layers to checkpoint (from a memory budget)
and how the DataLoader runs (worker processes, prefetch, pinned memory). Pure functions, unit-tested.

Activation model (per device, bf16 training, LoRA or frozen base, the project's step: last-position logits,
frozen vision tower without autograd)::

    peak ≈ weights + T · hidden · (BASE + KEPT · (layers − checkpointed))        bytes

``T`` = tokens of the longest micro-batch the data produces (padded: rows × longest row; packed, with
``model.pack_pairs``: its real tokens), ``hidden`` the language model's hidden size. ``KEPT`` is what one decoder layer that keeps its activations costs per token
and hidden unit; ``BASE`` everything else that grows with tokens (checkpointed layer inputs, the layer being
recomputed, attention and MLP transients, the vision tower's output, allocator slack).

Calibration, Qwen2.5-VL-7B on one H200 (docs/benchmarks.md, docs field notes 2026-12-02/03; groups of 8):

* the isolated step at 853 real tokens/pair (7,770 padded tokens a group): 20.4 GiB with 28/28 layers
  checkpointed, 39.9 GiB with 16, 50.6 GiB with 10 -> one kept layer costs 1.68 GiB at 7,770 tokens:
  KEPT ≈ 65 bytes per token and hidden unit;
* a real stage with 17/28 layers checkpointed: 33.3 GiB at 867 tokens/pair, 44.3 GiB at 1409 tokens/pair ->
  2.6 MiB per token at 11 kept layers, intercept 15.7 GiB ≈ the 8.29B bf16 weights (15.4 GiB):
  BASE + 11·KEPT ≈ 760 bytes per token and hidden unit -> BASE ≈ 45.

Under this model the 1409-token case needs 19 checkpointed layers for 40 GiB (17 overshot, as measured);
the chooser keeps ``margin`` (5% of the budget by default) in hand, which makes it 20. The isolated step
(synthetic inputs, more padding) sits ~3-5 GiB above this model: the benchmark prints both peaks.

Those constants (``PADDED``) describe padded batches on the plain PyTorch path. With ``model.pack_pairs`` and
liger's fused kernels (the Qwen2.5-VL default on CUDA) a kept layer costs much less: no padding tokens, and the
fused SwiGLU/RMSNorm/rotary keep fewer intermediates. ``PACKED_FUSED`` is fitted on three real stages on one
H100 (benchmarks/results/2026-12-05_h100_train_stage_{22,38,70}gib.txt: 7,123 tokens a micro-batch, 26 / 16 / 0
layers checkpointed, 19.2 / 28.3 / 42.8 GiB; least squares gives base 82.0, kept 38.2, rounded up to 85 / 39 so
it over-predicts by at most 0.6 GiB) and predicts the two packed H200 stages it was not fitted on within 0.3 GiB
(29.5 GiB measured at 7,133 tokens and 15 layers, 30.8 at 11,752 and 20). For a 40 GiB budget it checkpoints
6/28 layers at 851 tokens/pair instead of 15 (less recomputation, a faster step), and 16 at 1,391 tokens/pair,
where the H100 stage then peaked at 36.6 GiB against 37.1 predicted.

``PACKED_FUSED_LORA`` adds the one-function LoRA branch (reranker/lora_branch.py, ``model.lora.fused``, on by
default on CUDA): peft's forward kept, for each adapted projection, the dropout's mask and a dropped bf16 copy of the
input (3 bytes a value, 12 per token and hidden unit for q/k/v/o); the branch keeps the input once. Fitted on one
H100 (benchmarks/results/2026-12-06_h100_*lora_branch*.txt, 7,123 tokens a micro-batch): real stages with 0, 1 and 23
of 28 layers checkpointed peaked at 37.7, 37.0 and 21.0 GiB (42.8 with peft's forward at 0); least squares gives
base ~81, kept ~30.5, rounded up to 85 / 31 so every point is predicted from above, within 0.4 GiB; the isolated step
(7,199 tokens) lost 4.5 GiB from 6 checkpointed layers, 4.47 predicted. For a 40 GiB budget at 851 tokens/pair it
checkpoints 1 layer (the stage: 37.0 GiB, 17.1 pairs/s), for 22 GiB 24.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ActivationCosts:
    """The activation model's two constants, in bytes per token and hidden unit: ``base`` (all that grows with
    tokens besides the kept layers) and ``kept`` (one decoder layer that keeps its activations)."""

    regime: str
    base: float
    kept: float


PADDED = ActivationCosts("padded batches, plain PyTorch path", base=45.0, kept=65.0)
PACKED_FUSED = ActivationCosts("packed pairs with fused kernels", base=85.0, kept=39.0)
PACKED_FUSED_LORA = ActivationCosts("packed pairs with fused kernels and the one-function LoRA branch",
                                    base=85.0, kept=31.0)


def activation_costs(packed: bool, fused: bool, lora_branch: bool = False) -> ActivationCosts:
    """The constants of the regime a stage runs in; anything but packed-and-fused uses the (larger) padded ones.
    ``lora_branch``: the LoRA layers run reranker/lora_branch.py's function (no dropout mask or dropped copy kept)."""
    if packed and fused:
        return PACKED_FUSED_LORA if lora_branch else PACKED_FUSED
    return PADDED


@dataclass(frozen=True)
class CheckpointChoice:
    layers: int  # decoder layers checkpointed (0 = off)
    num_layers: int
    predicted_peak_gib: float
    budget_gib: float
    tokens: int  # tokens of the longest micro-batch the choice was made for
    fits: bool  # False: even with every layer checkpointed the prediction exceeds the budget
    regime: str = PADDED.regime  # the ActivationCosts the prediction used

    def describe(self) -> str:
        return (f"activation checkpointing auto: {self.layers}/{self.num_layers} decoder layers checkpointed for "
                f"{self.tokens} tokens per micro-batch; predicted peak {self.predicted_peak_gib:.1f} GiB of a "
                f"{self.budget_gib:.1f} GiB budget ({self.regime})"
                + ("" if self.fits else " (OVER budget even with all layers)"))


def predicted_peak_gib(tokens: int, hidden: int, num_layers: int, checkpointed: int, weight_bytes: int,
                       costs: ActivationCosts = PADDED) -> float:
    """Peak device memory (GiB) predicted by the activation model above."""
    kept_layers = num_layers - max(0, min(num_layers, checkpointed))
    return (weight_bytes + tokens * hidden * (costs.base + costs.kept * kept_layers)) / GIB


def choose_checkpoint_layers(tokens: int, hidden: int, num_layers: int, weight_bytes: int, budget_gib: float,
                             margin: float = 0.05, costs: ActivationCosts = PADDED) -> CheckpointChoice:
    """The fewest checkpointed decoder layers whose predicted peak is within ``budget_gib · (1 − margin)``.

    Fewer checkpointed layers = less recomputation = a faster step, so the smallest count that fits wins.
    If none fits, every layer is checkpointed and ``fits`` is False (the caller logs a warning).
    """
    if tokens < 0 or hidden <= 0 or num_layers < 0 or budget_gib <= 0:
        raise ValueError("tokens, hidden, num_layers and budget_gib must be positive")
    limit = budget_gib * (1.0 - margin)
    for k in range(num_layers + 1):
        peak = predicted_peak_gib(tokens, hidden, num_layers, k, weight_bytes, costs)
        if peak <= limit:
            return CheckpointChoice(k, num_layers, peak, budget_gib, int(tokens), True, costs.regime)
    peak = predicted_peak_gib(tokens, hidden, num_layers, num_layers, weight_bytes, costs)
    return CheckpointChoice(num_layers, num_layers, peak, budget_gib, int(tokens), False, costs.regime)


# QLoRA's weights against bf16: the language model in nf4 with double quantization (~0.53 bytes a parameter),
# the vision tower and lm_head kept in bf16 (load_reranker skips them): ~0.37 of the bytes for Qwen2.5-VL-7B
QLORA_WEIGHT_FRACTION = 0.37


def over_budget_advice(choice: CheckpointChoice, hidden: int, weight_bytes: int, pairs_per_micro_batch: int,
                       margin: float = 0.05, costs: ActivationCosts = PADDED) -> str | None:
    """One line naming the setting to change when ``choice`` does not fit even with every layer checkpointed
    (None when it fits): a smaller ``max_pixels`` / ``max_length`` (with the tokens per pair that would fit) where
    the weights leave room for activations, QLoRA where they alone (nearly) fill the budget."""
    if choice.fits:
        return None
    limit = choice.budget_gib * (1.0 - margin) * GIB
    room_tokens = (limit - weight_bytes) / (hidden * costs.base)  # tokens per micro-batch with every layer checkpointed
    per_pair = int(room_tokens // max(1, pairs_per_micro_batch))
    head = (f"memory budget {choice.budget_gib:.0f} GiB: even with all {choice.num_layers} decoder layers "
            f"checkpointed the memory model predicts {choice.predicted_peak_gib:.1f} GiB for {choice.tokens} tokens a "
            f"micro-batch (weights {weight_bytes / GIB:.1f} GiB)")
    if per_pair >= 64:
        return (f"{head}; change a setting: at most ~{per_pair} tokens per pair fit (a smaller training.max_pixels "
                f"or max_length), or model.finetune: qlora (4-bit base weights), or a larger memory_budget_gib")
    qlora = weight_bytes * QLORA_WEIGHT_FRACTION
    hint = "" if qlora < limit else " with a smaller model (the 2B of the next family)"
    return (f"{head}; the weights leave no room for activations: set model.finetune: qlora (4-bit base weights, "
            f"~{qlora / GIB:.1f} GiB){hint}, or a larger memory_budget_gib")


def resolve_dataloader(params: dict | None, device_type: str, cpus: int, local_processes: int) -> dict:
    """DataLoader keyword arguments from ``training.dataloader`` (``auto`` values resolved).

    ``auto``: on CUDA min(4, CPUs per process − 1) workers (one CPU stays with the training loop), prefetch 2
    per worker, persistent workers, pinned memory; on CPU 0 workers (collation competes with the model for the
    same cores), no pinning. Explicit values are kept; prefetch/persistence are dropped without workers
    (PyTorch refuses them).
    """
    params = dict(params or {})
    per_process = max(1, cpus // max(1, local_processes))
    workers = params.get("num_workers", "auto")
    if workers == "auto":
        workers = min(4, per_process - 1) if device_type == "cuda" else 0
    workers = max(0, int(workers))
    pin = params.get("pin_memory", "auto")
    pin = device_type == "cuda" if pin == "auto" else bool(pin)
    out = {"num_workers": workers, "pin_memory": pin and device_type == "cuda"}
    if workers > 0:
        prefetch = params.get("prefetch_factor", "auto")
        persistent = params.get("persistent_workers", "auto")
        out["prefetch_factor"] = 2 if prefetch == "auto" else int(prefetch)
        out["persistent_workers"] = True if persistent == "auto" else bool(persistent)
    return out


def longest_micro_batch_tokens(pair_tokens: list[int], pairs_per_micro_batch: int, packed: bool = False) -> int:
    """Tokens of the worst micro-batch. Padded: every row padded to the longest pair seen. Packed
    (``model.pack_pairs``, no padding tokens): the longest pairs seen, side by side."""
    if not pair_tokens:
        return 0
    if packed:
        return int(sum(sorted(pair_tokens, reverse=True)[: int(pairs_per_micro_batch)]))
    return int(max(pair_tokens)) * int(pairs_per_micro_batch)


def weights_bytes(model) -> int:
    """Bytes of every parameter and buffer on the model's device(s)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        total += t.numel() * t.element_size()
    return int(total)

