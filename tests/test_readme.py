"""The README's code blocks, run as written in a fresh copy of the project (issue 19, point 1).

Every ```bash and ```python block runs, in README order, unless its first line says why not:
`# (not run by tests/test_readme.py: <reason>)` (installs a venv, needs your data, the real model or GPUs).
Whatever the blocks write must be git-ignored in a clone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from project_runs import REPO, make_project_copy

README = REPO / "README.md"
NOT_RUN = "# (not run by tests/test_readme.py:"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[tuple[str, str, int]]:
    """(language, code, line number) of every fenced block."""
    text = README.read_text(encoding="utf-8")
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def runnable(blocks):
    return [b for b in blocks if b[0] in {"bash", "python"} and not b[1].lstrip().startswith(NOT_RUN)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env.update(KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the venv's kedro
    return env


def test_every_code_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    assert blocks, "no code blocks found in README.md"
    for lang, code, line in blocks:
        if lang in {"bash", "python"}:
            first = code.lstrip().splitlines()[0]
            assert first.startswith(NOT_RUN) or not first.startswith("# (not run"), (
                f"README.md:{line}: a skip marker must read {NOT_RUN!r} ... ')'")
        elif lang == "yaml":
            assert isinstance(yaml.safe_load(code), dict), f"README.md:{line}: the YAML block does not parse"
        else:  # output samples, not commands
            assert lang == "", f"README.md:{line}: a ```{lang} block is neither run nor marked"
    run = runnable(blocks)
    assert any(lang == "python" for lang, _, _ in run), "the Python API example must run"
    assert all("--pipeline " not in code for _, code, _ in blocks), "use --pipelines (--pipeline is deprecated)"


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_readme_blocks_run_as_written_and_write_only_ignored_files(tmp_path: Path):
    project = make_project_copy(tmp_path / "project")
    # kedro puts <project>/src first on sys.path: the copy runs this checkout's source
    shutil.rmtree(project / "src")
    shutil.copytree(REPO / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    before = _files(project)
    for lang, code, line in runnable(readme_blocks()):
        command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(command, cwd=project, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (
            f"README.md:{line} ({lang}) failed with {proc.returncode}:\n{code}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    written = sorted(_files(project) - before)
    assert any(p.startswith("data/06_models/my_adapter/") for p in written), written[:20]
    not_ignored = []
    for chunk in range(0, len(written), 500):
        paths = written[chunk:chunk + 500]
        proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "--stdin"],
                              input="\n".join(paths), capture_output=True, text=True)
        ignored = set(proc.stdout.split())
        not_ignored += [p for p in paths if p not in ignored and "__pycache__" not in p]
    assert not not_ignored, f"the README's commands write files a clone does not git-ignore: {not_ignored[:20]}"


@pytest.mark.parametrize("target", ["smoke", "full"])
def test_makefile_uses_pipelines_option(target):
    makefile = (REPO / "Makefile").read_text()
    line = next(x for x in makefile.splitlines() if x.strip().startswith("$(BIN)/kedro run") and target in x)
    assert "--pipelines " + target in line
