"""The export node: ``export:`` typed, the model exported by the library (``lychee_pipeline.export``)."""

from __future__ import annotations

import logging
from typing import Any

from lychee_pipeline.export import ExportParams, export_model
from lychee_pipeline.project import project_root
from lychee_pipeline.runtime.errors import typed

log = logging.getLogger(__name__)


def export_merged_model(export: dict[str, Any]) -> dict[str, Any]:
    """Write the standalone folder of ``export.model``; the summary says what and where."""
    summary = export_model(typed(ExportParams, "export", export), project_root())
    log.info("export: %s -> %s (%s, %s; %s)", summary["model"], summary["output_dir"], summary["family"],
             ", ".join(summary["architectures"]),
             "evaluated" if summary["evaluated"] else "not evaluated")
    return summary
