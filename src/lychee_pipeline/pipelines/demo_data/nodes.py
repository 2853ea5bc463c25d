"""Demo-data node: generate the synthetic catalogue (cached by its marker)."""

from __future__ import annotations

import logging
from typing import Any

from lychee_pipeline.data.catalogue import ensure_demo_data

logger = logging.getLogger(__name__)


def generate_demo_data(demo_data: dict[str, Any]) -> dict[str, Any]:
    """Generate (or reuse) the demo catalogue and return a summary of what is on disk."""
    summary = ensure_demo_data(demo_data)
    logger.info("demo data: %d records, %d images in %s (%s)", summary["records"], summary["images"],
                summary["image_roots"][0], "generated" if summary["generated"] else "reused")
    return summary
