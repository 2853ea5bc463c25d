"""A short plain-torch training loop on a small learnable set lowers the loss (LoRA, pointwise and listwise)."""

import pytest
import torch

from lychee_pipeline.reranker import GroupCollator, listwise_loss, pointwise_loss

COLOURS = ["red", "blue", "green", "black", "white", "yellow"]


def _rows(images):
    """Query 'X shoes'; the relevant document names colour X, the others other colours."""
    rows = []
    for i, colour in enumerate(COLOURS):
        others = [c for c in COLOURS if c != colour]
        rows.append(
            {
                "record_id": f"r{i}",
                "query": {"text": f"{colour} shoes", "image": None},
                "positives": [{"doc_id": f"p{i}", "text": f"{colour} shoes", "image": None, "meta": "{}"}],
                "negatives": [
                    {"doc_id": f"n{i}{j}", "text": f"{c} shoes", "image": images["red"] if j == 0 else None,
                     "hard": j < 2, "meta": "{}"}
                    for j, c in enumerate(others)
                ],
                "task_type": "t2t",
            }
        )
    return rows


@pytest.mark.parametrize("loss_name", ["pointwise", "listwise"])
def test_thirty_steps_lower_the_loss(make_model, images, loss_name):
    torch.manual_seed(0)
    model = make_model(finetune="lora", lora={"dropout": 0.0})
    collator = GroupCollator(model.processor, group_size=4, max_length=256, seed=0)
    rows = _rows(images)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)

    def loss_of(batch):
        logits = model(**batch)
        if loss_name == "pointwise":
            return pointwise_loss(logits, batch["labels"])
        return listwise_loss(logits, batch["group_size"], temperature=1.0)

    eval_batch = collator(rows)
    with torch.no_grad():
        before = loss_of(eval_batch).item()
    model.train()
    for step in range(30):
        collator.set_epoch(step)  # negatives re-drawn every step
        batch = collator(rows)
        loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        after = loss_of(eval_batch).item()
        logits = model(**eval_batch)
    print(f"{loss_name}: loss {before:.4f} -> {after:.4f}")
    assert after < 0.8 * before, (before, after)
    # the positive (first of each group) now outranks its negatives in most groups
    margin = (logits[:, 0] - logits[:, 1]).view(-1, 4)
    assert (margin[:, 0] > margin[:, 1:].max(dim=1).values).float().mean().item() >= 0.5
