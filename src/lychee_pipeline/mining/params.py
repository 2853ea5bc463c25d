"""The ``mining:`` parameters as one typed object (conf/base/parameters_mining.yml; docs/data.md explains each).

Kedro-free; a missing key takes the default here (tests/pipelines/mine_negatives/test_mining.py checks that
the YAML agrees with these defaults), an unknown or ill-typed one is an error naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class MiningParams(BaseModel):
    """``mining:`` parameters (conf/base/parameters_mining.yml; docs/data.md explains each)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    smoke_enabled: bool = False
    model: str | None = None  # null: the run's model.name_or_path
    adapter: str | None = None
    reranker: dict[str, Any] = {}
    instruction: str | None = None
    bm25_k: int = 50
    image_k: int = 20
    hash_size: int = 8
    image_workers: int = 2
    rescore_top: int = 30
    rank_window: tuple[int, int] = (3, 30)
    relative_margin: float = 0.95
    near_duplicate_distance: int = 4
    near_duplicate_colour: int = 6
    n_mined: int = 4
    n_random: int = 3
    fill_with_random: bool = True
    seed: int = 0
    batch_queries: int = 512
    cache_path: str | None = "data/04_feature/mining_cache.sqlite"
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> MiningParams:
        a, b = self.rank_window
        if not 1 <= a <= b:
            raise ValueError(f"mining.rank_window must be [a, b] with 1 <= a <= b, got [{a}, {b}]")
        if b > self.rescore_top:
            raise ValueError(
                f"mining.rank_window ends at rank {b} but only mining.rescore_top={self.rescore_top} candidates "
                "are rescored: raise rescore_top or lower the window"
            )
        for name in ("bm25_k", "image_k", "n_mined", "n_random", "near_duplicate_distance", "near_duplicate_colour"):
            if getattr(self, name) < 0:
                raise ValueError(f"mining.{name} must be >= 0")
        if self.rescore_top < 1 or self.batch_queries < 1 or self.hash_size < 2 or self.image_workers < 1:
            raise ValueError("mining.rescore_top, batch_queries and image_workers must be >= 1, hash_size >= 2")
        if not 0 < self.relative_margin:
            raise ValueError("mining.relative_margin must be > 0 (1.0 drops candidates scored above the positive)")
        return self
