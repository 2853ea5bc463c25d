"""The package's layers, checked on its source with `ast` (no import runs):

- outside `training/` and `pipelines/training/`, only training's typed contract is imported from
  `lychee_pipeline.training` (its parameters in training/config.py, its spec and result in training/stage.py);
- no private name (`_x`) is imported, or read off an imported module, across packages;
- the runtime (`lychee_pipeline.runtime`) imports nothing from training, evaluation or the pipelines.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "lychee_pipeline"
TRAINING_CONTRACT = {"lychee_pipeline.training.config", "lychee_pipeline.training.stage"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return out


def _owner(module: str) -> str:
    """The package a module belongs to: `training`, `runtime`, ..., or `pipelines.<name>` for a pipeline."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "pipelines" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 or (SRC / PACKAGE / parts[0]).is_dir() else ""  # a top-level module: ""


def _imports(module: str, tree: ast.Module):
    """(line, imported module, imported name or None) of every import of the package, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".")
                is_package = (SRC / Path(*here) / "__init__.py").is_file()
                anchor = here[: len(here) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith(PACKAGE):
                for alias in node.names:
                    yield node.lineno, base, alias.name


def _violations() -> tuple[list[str], list[str], list[str]]:
    modules = _modules()
    contract, private, runtime = [], [], []
    for module, tree in modules.items():
        owner = _owner(module)
        aliases: dict[str, str] = {}  # local name -> imported module of another package
        for line, target, name in _imports(module, tree):
            full = f"{target}.{name}" if name and f"{target}.{name}" in modules else target
            where = f"{module}:{line} imports {target}{'.' + name if name else ''}"
            if owner not in ("training", "pipelines.training") and (
                    full == "lychee_pipeline.training" or full.startswith("lychee_pipeline.training.")) \
                    and full not in TRAINING_CONTRACT:
                contract.append(where)
            if owner == "runtime" and _owner(full) in ("training", "evaluation") or (
                    owner == "runtime" and full.startswith("lychee_pipeline.pipelines")):
                runtime.append(where)
            if _owner(full) != owner:
                if name and name.startswith("_") and not name.startswith("__"):
                    private.append(where)
                if name and full != target:  # `from lychee_pipeline.x import module`: watch module._name
                    aliases[name] = full
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    return contract, private, runtime


def test_only_trainings_typed_contract_is_imported_from_outside_training():
    contract, _, _ = _violations()
    assert contract == [], "\n".join(contract)


def test_no_private_name_is_imported_across_packages():
    _, private, _ = _violations()
    assert private == [], "\n".join(private)


def test_the_runtime_imports_nothing_above_it():
    _, _, runtime = _violations()
    assert runtime == [], "\n".join(runtime)


def test_the_checks_see_what_they_look_for(tmp_path, monkeypatch):
    """The walker finds a forbidden import, a private name and a private attribute (so the tests above can fail)."""
    package = tmp_path / PACKAGE
    for folder in ("training", "evaluation", "runtime"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "training" / "planning.py").write_text("def _hidden(): ...\n")
    (package / "training" / "stage.py").write_text("class StageSpec: ...\n")
    (package / "evaluation" / "scoring.py").write_text(
        "from lychee_pipeline.training.planning import _hidden\n"
        "from lychee_pipeline.training import planning\n"
        "from lychee_pipeline.training.stage import StageSpec\n"
        "planning._hidden()\n")
    (package / "runtime" / "launcher.py").write_text("from lychee_pipeline.training.stage import StageSpec\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    contract, private, runtime = _violations()
    assert [c.split(" imports ")[1] for c in contract] == ["lychee_pipeline.training.planning._hidden",
                                                          "lychee_pipeline.training.planning"]
    assert [p.split(" ", 1)[1] for p in private] == ["imports lychee_pipeline.training.planning._hidden",
                                                    "reads lychee_pipeline.training.planning._hidden"]
    assert [r.split(" imports ")[1] for r in runtime] == ["lychee_pipeline.training.stage.StageSpec"]
