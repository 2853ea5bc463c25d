"""Hard-negative mining for image-and-text reranker training data (Kedro-free): BM25 and perceptual-hash
candidates, reranker rescoring with a score cache, rank-window selection with false-negative filtering."""

from .first_stage import ImageIndex, TextIndex, fuse, image_signature, normalize_text, tokenize
from .mine import LOG_SCHEMA, MiningResult, mine_table, model_key, score_histogram, select_negatives
from .params import MiningParams

__all__ = [
    "LOG_SCHEMA",
    "ImageIndex",
    "MiningParams",
    "MiningResult",
    "TextIndex",
    "fuse",
    "image_signature",
    "mine_table",
    "model_key",
    "normalize_text",
    "score_histogram",
    "select_negatives",
    "tokenize",
]
