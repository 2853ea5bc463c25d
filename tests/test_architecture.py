"""The layers hold: no pipeline imports another pipeline (each is wiring over the libraries below it)."""

from __future__ import annotations

import ast
from pathlib import Path

PIPELINES = Path(__file__).resolve().parents[1] / "src" / "lychee_pipeline" / "pipelines"
PREFIX = "lychee_pipeline.pipelines."

def _imported_pipelines(path: Path, own: str) -> set[str]:
    """The other pipelines a module imports (absolute `lychee_pipeline.pipelines.X` or relative `..X`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level >= 2:  # `from ..other import x` inside pipelines/<own>/
                names = [PREFIX + (node.module or "")] if node.module else [PREFIX + a.name for a in node.names]
            elif node.level == 1:
                continue  # `from .nodes import x`: its own package
            else:
                names = [node.module or ""]
                if node.module == PREFIX.rstrip("."):
                    names = [PREFIX + alias.name for alias in node.names]
        else:
            continue
        found.update(name[len(PREFIX):].split(".")[0] for name in names if name.startswith(PREFIX))
    return found - {own}


def pipeline_imports() -> set[tuple[str, str]]:
    return {(folder.name, other) for folder in sorted(PIPELINES.iterdir()) if folder.is_dir()
            for module in folder.rglob("*.py") for other in _imported_pipelines(module, folder.name)}


def test_no_pipeline_imports_another_pipeline():
    assert pipeline_imports() == set()


def test_the_walk_sees_an_import_between_pipelines(tmp_path):
    """The check can fail: each import form it must catch is caught."""
    module = tmp_path / "nodes.py"
    module.write_text("from lychee_pipeline.pipelines.data_ingestion.nodes import x\n"
                      "import lychee_pipeline.pipelines.rerank.nodes\n"
                      "from lychee_pipeline.pipelines import registry\n"
                      "from ..reporting import nodes\n"
                      "from .nodes import y\n", encoding="utf-8")
    assert _imported_pipelines(module, "mine") == {"data_ingestion", "rerank", "registry", "reporting"}
