"""`kedro viz build` (the static export) shows every pipeline, node, layer and stage tag.

kedro-viz 12.5 writes the API responses the web app reads as JSON files without extension:
``build/api/main`` (the default pipeline, plus the list of pipelines), ``build/api/pipelines/<id>``
and ``build/api/nodes/<node id>``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from user_tools_support import kedro

LAYERS = ["raw", "intermediate", "primary", "model_input", "models", "model_output", "reporting"]
SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$")  # at least two words: "verb_object"


def _registered():
    from lychee_pipeline.pipeline_registry import register_pipelines

    return register_pipelines()


def test_viz_build_exports_every_pipeline_node_layer_and_stage_tag(project_copy):
    kedro(project_copy, "viz", "build", timeout=180)
    api = project_copy / "build" / "api"
    assert (project_copy / "build" / "index.html").is_file()
    main = json.loads((api / "main").read_text())
    registered = _registered()

    # every registered pipeline is listed and exported
    assert {p["id"] for p in main["pipelines"]} == set(registered)
    for pid in registered:
        assert (api / "pipelines" / pid).is_file(), pid

    for pid in ("smoke", "full"):
        exported = json.loads((api / "pipelines" / pid).read_text())
        by_type: dict[str, dict[str, dict]] = {}
        for n in exported["nodes"]:
            # kedro-viz names a namespaced task by its own name, inside its namespace's group
            group = n.get("modular_pipelines") or [] if n["type"] == "task" else []
            by_type.setdefault(n["type"], {})[".".join([*group, n["name"]])] = n
        tasks, datasets = by_type["task"], by_type.get("data", {})
        pipeline = registered[pid]

        # every node of the pipeline, under its own name, with its tags
        assert set(tasks) == {n.name for n in pipeline.nodes}, pid
        for n in pipeline.nodes:
            assert set(tasks[n.name]["tags"]) == set(n.tags), n.name
            # a namespaced node is `<group>[.<stage>].<name>`: its own name says what it does
            assert SNAKE.match(n.name.split(".")[-1]), f"node name {n.name!r} does not say what it does"
            assert all(re.fullmatch(r"[a-z][a-z0-9_]*", part) for part in n.name.split(".")[:-1]), n.name

        # every dataset (not params) has a layer, and the layers are ordered raw -> ... -> reporting
        free = {d for d in pipeline.datasets() if not d.startswith("params:") and d != "parameters"}
        assert set(datasets) == free, pid
        missing = sorted(name for name, d in datasets.items() if d.get("layer") not in LAYERS)
        assert not missing, f"{pid}: datasets without a known layer: {missing}"
        assert exported["layers"] == LAYERS, f"{pid}: layers {exported['layers']} (a cycle empties the list)"

        # the training stages are tagged, so kedro-viz can filter on them
        stage_nodes = [n for n in pipeline.nodes if ".train_stage_" in f".{n.namespace}"]
        assert stage_nodes, pid
        for n in stage_nodes:
            assert "training" in n.tags and any(t.startswith("stage_") for t in n.tags), n.name
        if pid == "full":
            stage_tags = {t for n in stage_nodes for t in n.tags if t.startswith("stage_")}
            # one slot per rung of the ladder (1, 2, 4, ... 128 devices), then the final stage
            assert stage_tags == {f"stage_{2 ** k}" for k in range(8)} | {"stage_final"}
            # each stage is one namespace (a collapsible group in kedro-viz, inside `training`) holding its run
            # and its gate
            groups = {n["name"] for n in exported["nodes"] if n["type"] == "modularPipeline"}
            assert {f"training.train_stage_{2 ** k}" for k in range(8)} | {"training.train_stage_final"} <= groups, groups

    # the default view is the smoke pipeline, and each dataset has a metadata page (filepath, type)
    assert {".".join([*(n.get("modular_pipelines") or []), n["name"]]) for n in main["nodes"] if n["type"] == "task"} \
        == {n.name for n in registered["smoke"].nodes}
    ids = {n["name"]: n["id"] for n in main["nodes"]}
    page = json.loads((api / "nodes" / ids["normalized_records"]).read_text())
    assert page["filepath"].endswith("data/03_primary/normalized_records.parquet")
    assert page["type"].endswith("ArrowTableDataset")


def test_offline_kedro_viz_run_greets_with_none_as_the_readme_says(project_copy):
    """"Kedro-Viz None is here!" is kedro-viz's update check without PyPI: `/api/version` turns the missing latest
    version into the text "None", and the installed version compares below it as a string, so the web app thinks
    an upgrade exists. Nothing of the project's: the README says so. (PyPI made unreachable through a proxy
    that refuses connections; when kedro-viz answers otherwise, the README's sentence must change.)"""
    import os
    import random
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    import kedro_viz

    from user_tools_support import user_env

    def free_port() -> int:
        # kedro-viz refuses a port above 49151 (the dynamic range), where the OS hands out port 0's
        for port in random.sample(range(20000, 49152), 200):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise AssertionError("no free port below 49152")

    closed = free_port()
    proxy = f"http://127.0.0.1:{closed}"
    env = user_env(HTTP_PROXY=proxy, HTTPS_PROXY=proxy, http_proxy=proxy, https_proxy=proxy, NO_PROXY="127.0.0.1",
                   no_proxy="127.0.0.1")
    log_path, port, version = project_copy / "viz.log", free_port(), None
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kedro", "viz", "run", "--no-browser", "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=project_copy, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while version is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=5) as r:
                    version = json.loads(r.read())
            except OSError:
                time.sleep(1)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own session, started above
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass  # it had already ended, with its whole session
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    said = log_path.read_text(encoding="utf-8", errors="replace")
    assert version is not None, f"kedro viz run did not come up (exit {proc.returncode}):\n{said[-4000:]}"
    assert version == {"installed": kedro_viz.__version__, "is_outdated": True, "latest": "None"}, version
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "Kedro-Viz None is here!" in readme
