"""Shared fixtures of the data-layer tests: a bad-input corpus built in a temporary folder."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import types
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from PIL import Image


def _png(path: Path, mode: str = "RGB", size: tuple[int, int] = (32, 32), colour: Any = (200, 30, 30)) -> None:
    Image.new(mode, size, colour).save(path)


def _line(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def _rec(rid: str, pos_image: str | None, neg: list[dict] | None = None, query: Any = None) -> dict:
    return {
        "id": rid,
        "query": query if query is not None else f"query for {rid}",
        "pos_doc": {"text": f"positive of {rid}", "image": pos_image},
        "neg_docs": neg if neg is not None else [{"text": f"a text-only negative of {rid}"}],
    }


@pytest.fixture
def data_bad_corpus(tmp_path: Path) -> dict[str, Any]:
    """Raw JSONL + images covering every bad case of issue 2, with the expected outcome of each."""
    root = tmp_path / "raw"
    images = root / "images"
    images.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    _png(outside / "secret.png")
    _png(images / "good.png")
    _png(images / "good2.png", colour=(30, 30, 200))
    (images / "zero.png").write_bytes(b"")
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, format="JPEG", quality=95)
    (images / "truncated.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (images / "text.jpg").write_text("this is not an image\n")
    Image.new("1", (3000, 3000)).save(images / "huge.png")
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(images / "cmyk.jpg")
    _png(images / "rgba.png", "RGBA", (16, 16), (1, 2, 3, 128))
    Image.new("I;16", (16, 16), 40000).save(images / "gray16.png")
    Image.new("RGB", (16, 16), (9, 9, 9)).convert("P").save(images / "palette.png")
    _png(images / "gray.png", "L", (16, 16), 128)
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(images / "anim.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    os.symlink(outside / "secret.png", images / "link.png")

    good_neg = {"text": "a black suit", "image": "images/good2.png"}
    first = {"query": "  红色连衣裙适合什么场合 👗  ", "pos_doc": {"text": "红色连衣裙", "image": "images/good.png"},
             "neg_docs": [good_neg]}
    nfc, nfd = unicodedata.normalize("NFC", "café crème"), unicodedata.normalize("NFD", "café crème")
    lines: list[bytes] = [
        b"\xef\xbb\xbf" + _line(first) + b"\r\n",                                    # 1 BOM + CRLF, Chinese/emoji
        b'{"query": "x", "pos_doc": {"text": "y"}\r\n',                               # 2 malformed JSON
        _line({"pos_doc": {"text": "y"}}) + b"\n",                                   # 3 missing query
        _line({"query": "a", "pos_doc": {"text": "y"}, "neg_doc": [{"text": "z"}]}) + b"\n",  # 4 extra field
        _line({"query": 5, "pos_doc": {"text": "y"}}) + b"\n",                       # 5 wrong type (query)
        _line({"query": "a", "pos_doc": {"text": "y"}, "neg_docs": {"text": "z"}}) + b"\n",  # 6 wrong type (negs)
        _line({"query": "   ", "pos_doc": {"text": "y"}}) + b"\n",                  # 7 empty query
        _line({"query": "a", "neg_docs": [{"text": "z"}]}) + b"\n",                 # 8 no positive
        _line(first) + b"\n",                                                        # 9 duplicate of 1
        _line({"query": nfc, "pos_doc": {"text": "t"}, "neg_docs": [{"text": "n"}]}) + b"\n",  # 10
        _line({"query": nfd + " ", "pos_doc": {"text": "t"}, "neg_docs": [{"text": "n"}]}) + b"\n",  # 11 dup of 10
        b"[1, 2]\n",                                                                 # 12 not an object
        b'{"query": "\xff\xfe", "pos_doc": {"text": "y"}}\n',                        # 13 invalid UTF-8
        b"   \n",                                                                    # 14 empty line
        _line({"id": "same", "query": "q1", "pos_doc": {"text": "y"}, "neg_docs": [{"text": "n"}]}) + b"\n",  # 15
        _line({"id": "same", "query": "q2", "pos_doc": {"text": "y"}}) + b"\n",      # 16 duplicate id
        _line({"query": "a", "pos_doc": {"text": "", "image": " "}}) + b"\n",       # 17 empty document
        _line({"query": "a", "pos_doc": {"text": "y", "meta": "popular"}}) + b"\n",  # 18 meta not an object
    ]
    rejected = {2: "malformed JSON", 3: "missing field 'query'", 4: "unknown field 'neg_doc'",
                5: "wrong type at 'query'", 6: "wrong type at 'neg_docs'", 7: "empty query", 8: "no positive",
                12: "not a JSON object", 13: "invalid UTF-8", 14: "empty line", 16: "duplicate id 'same'",
                17: "empty document", 18: "wrong type at 'pos_doc.meta'"}
    duplicates = 2
    quarantined = {
        "img-missing": "image not found", "img-zero": "zero-byte file", "img-truncated": "corrupt image",
        "img-text": "not a decodable image", "img-traversal": "path escapes the image roots",
        "img-symlink": "path escapes the image roots", "img-outside": "path escapes the image roots",
        "img-huge": "too many pixels", "neg-left-none": "fewer than data_processing.normalization.min_negatives: 0 < 1 (1 removed",
        "query-missing": "query image not found",
    }
    refs = {"img-missing": "images/missing.png", "img-zero": "images/zero.png",
            "img-truncated": "images/truncated.jpg", "img-text": "images/text.jpg",
            "img-traversal": "../../etc/passwd", "img-symlink": "images/link.png",
            "img-outside": "../outside/secret.png", "img-huge": "images/huge.png"}
    modes = {"mode-cmyk": ("images/cmyk.jpg", "CMYK", "JPEG"), "mode-rgba": ("images/rgba.png", "RGBA", "PNG"),
             "mode-16bit": ("images/gray16.png", "I;16", "PNG"), "mode-palette": ("images/palette.png", "P", "PNG"),
             "mode-gray": ("images/gray.png", "L", "PNG"), "mode-gif": ("images/anim.gif", "P", "GIF")}
    for rid, ref in refs.items():
        lines.append(_line(_rec(rid, ref)) + b"\n")
    for rid, (ref, _, _) in modes.items():
        lines.append(_line(_rec(rid, ref)) + b"\n")
    lines.append(_line(_rec("neg-removed", "images/good.png",
                            [{"id": "bad-neg", "image": "images/text.jpg"}, {"text": "fine negative"}])) + b"\n")
    lines.append(_line(_rec("neg-left-none", "images/good.png", [{"id": "zero-neg", "image": "images/zero.png"}]))
                 + b"\n")
    lines.append(_line(_rec("query-missing", "images/good.png", query={"image": "images/nowhere.png"})) + b"\n")
    lines.append(_line(_rec("image-query", "images/good.png", query={"image": "images/good2.png", "text": "like"}))
                 + b"\n")
    jsonl = root / "records.jsonl"
    jsonl.write_bytes(b"".join(lines))
    clean_ok = {"mode-cmyk", "mode-rgba", "mode-16bit", "mode-palette", "mode-gray", "mode-gif", "neg-removed",
                "image-query"}
    return {
        "root": root, "jsonl": jsonl, "lines_in": len(lines), "rejected": rejected, "duplicates": duplicates,
        "quarantined": quarantined, "modes": modes, "clean_ok": clean_ok,
        "source": {"files": [str(jsonl)], "image_roots": [str(root)], "demo": False},
    }


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> dict:
    """`kedro run --pipelines smoke` with the default parameters, typed in notebooks/ of a fresh project copy (the
    real CLI in a child process, as a user runs it). One run shared by the end-to-end, project-root and notebook
    tests: {"path": project root, "log": the command's output}."""
    from project_runs import kedro_run, make_cli_project

    root = make_cli_project(tmp_path_factory.mktemp("smoke_project") / "project")
    return {"path": root, "log": kedro_run(root / "notebooks", "--pipelines", "smoke")}


@pytest.fixture(scope="session")
def smoke_project(smoke_run) -> Path:
    """The project root of `smoke_run`, after its smoke run finished."""
    return smoke_run["path"]


@pytest.fixture(autouse=True)
def _no_mlflow_run_left_active():
    """Tests run several Kedro sessions in one process; a run one of them leaves active must not leak."""
    yield
    import sys

    if "mlflow" in sys.modules:
        mlflow = sys.modules["mlflow"]
        while mlflow.active_run() is not None:
            mlflow.end_run()


# --------------------------------------------------------------------------- the `slow` marker
# `make test-fast` (`pytest -m "not slow"`) is the inner loop; `make test` (CI) runs everything. The rule, applied
# here so that no test file carries it: a test is `slow` when it USES something that starts a Kedro project run,
# an `accelerate launch` stage, a server, a notebook kernel or a Python child process (a CLI, a driver script):
#   1. a fixture of SLOW_FIXTURES (directly, or through the fixtures it uses: pytest resolves the closure);
#   2. a name of PROCESS_STARTERS in its code, or in the code of its own module's helpers that it calls;
#   3. a module of END_TO_END_MODULES, whose tests start such things through helpers the rule cannot see.
# A new fixture or helper that starts a project, a stage or a server belongs in one of these lists.

SLOW_FIXTURES = {
    "smoke_run",                  # `kedro run --pipelines smoke` in a project copy (tests/conftest.py)
    "data_project",               # `kedro run --pipeline data` in a project copy (tests/user_tools)
    "newcomer_data_run",          # `kedro run --pipelines data` on an own corpus, then the run summary node
    "mlflow_server",              # `mlflow server` (tests/user_tools)
    "uninterrupted_reference",    # stage runs shared by the training tests (tests/training/conftest.py)
    "two_process_epoch",
    "two_process_accumulation",
    "trained_stage",              # a 1-process stage (tests/training/test_processing_travels.py)
    "crashed_then_resumed",       # two stage launches (tests/reliability/test_stage_faults.py)
    "champion_project",           # the registry node scoring in a project copy (tests/ship)
    "served_champion",            # `mlflow models serve` (tests/ship/test_serving.py)
    "qwen3_champion_project",     # the registry node scoring a Qwen3-VL champion (tests/ship/test_qwen3_vl_ship.py)
}
PROCESS_STARTERS = {
    "run_training_stage", "run_stage_slot", "run_stage",  # an `accelerate launch` stage
    "launch_scoring", "launch",               # an `accelerate launch` of the sharded scoring (or any LaunchJob)
    "run_kedro", "kedro_run", "kedro",        # a Kedro project run (in process or through the CLI)
    "served_model",                           # `mlflow models serve` (tests/ship/ship_support.py)
    "KedroSession",
    "NotebookClient",                         # a notebook kernel
    "executable",                             # sys.executable: a Python child process
}
END_TO_END_MODULES = {
    "test_readme.py",             # runs the README's shell blocks (make smoke, kedro run, ...)
    "test_training_pipeline.py",  # Kedro's runner on the training pipeline: real stages
    "test_scaled_scoring.py",     # evaluation scoring launched on 2 CPU processes
}


def _names_used(function: types.FunctionType, module: types.ModuleType, seen: set[str]) -> set[str]:
    """The global and attribute names `function`'s code refers to (nested functions included), followed into the
    functions of the test's own module that it calls."""
    names: set[str] = set()
    codes = [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for name in names - seen:
        helper = getattr(module, name, None)
        if isinstance(helper, types.FunctionType) and helper.__module__ == module.__name__:
            seen.add(name)
            names |= _names_used(helper, module, seen)
    return names


def is_slow(item: pytest.Item) -> bool:
    if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if item.path.name in END_TO_END_MODULES:
        return True
    function, module = getattr(item, "function", None), getattr(item, "module", None)
    return function is not None and module is not None and bool(
        PROCESS_STARTERS & _names_used(function, module, {function.__name__}))


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which then sees the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
    _group_shared_fixtures(items)
    _longest_first(items)
    _write_groups(config, items)
    # A -m on the command line replaces pyproject's `-m 'not online'`: `pytest -m "not slow"` must still leave the
    # online tests out. They run only when the expression names them (`pytest -m online`, as `make audit` does).
    if "online" not in (config.option.markexpr or ""):
        online = [item for item in items if item.get_closest_marker("online")]
        if online:
            config.hook.pytest_deselected(items=online)
            items[:] = [item for item in items if not item.get_closest_marker("online")]


# --------------------------------------------------------------------------- parallel runs (pytest-xdist)
# `make test` runs two workers with `--dist loadgroup`. A session- or module-scoped fixture of this suite (a smoke
# run, a tracking server, a trained stage) is made once per worker, so every test that shares one, directly or
# through another test sharing a second one, goes to the same worker: one `xdist_group` per connected set.


def _shared_fixtures(item: pytest.Item) -> list[str]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    shared = []
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        # a plugin's fixture (tmp_path_factory, ...) has no baseid; the suite's own carry their folder's
        if defs and defs[-1].scope != "function" and defs[-1].baseid:
            shared.append(f"{defs[-1].baseid}::{name}")
    return shared


def _group_shared_fixtures(items: list[pytest.Item]) -> None:
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {item.nodeid: _shared_fixtures(item) for item in items}
    for names in shared.values():
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    for item in items:
        if shared[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(root(shared[item.nodeid][0])))


# xdist 3.8 tells its controller a test's group by appending "@group" to the test's id, which pytest 9 no longer reads
# back (a node's id is built from its structured address): `--dist loadgroup` alone spread each group over both
# workers, and a shared fixture (the team server's 96 s) was built twice. So the workers write each test's group
# to a file the controller named, and the controller's scheduler (xdist's per-scope scheduling, the scope being
# that group) reads it once every worker has collected, before it hands out work.
GROUPS_FILE = "lychee_xdist_groups"
_GROUPS_KEY = pytest.StashKey[Path]()  # the controller's groups file


def _write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    target = getattr(config, "workerinput", {}).get(GROUPS_FILE)
    if not target:
        return
    groups = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        groups[item.nodeid] = mark.args[0] if mark else item.nodeid
    partial = Path(f"{target}.{config.workerinput['workerid']}")
    partial.write_text(json.dumps(groups), encoding="utf-8")
    os.replace(partial, target)  # the workers write the same content; either whole file will do


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist") \
            and config.getoption("dist", "no") == "loadgroup":
        config.stash[_GROUPS_KEY] = Path(tempfile.mkdtemp(prefix="lychee-xdist-")) / "groups.json"


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_GROUPS_KEY, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    path = node.config.stash.get(_GROUPS_KEY, None)
    if path is not None:
        node.workerinput[GROUPS_FILE] = str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    path = config.stash.get(_GROUPS_KEY, None)
    if path is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            return self.groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


# Work goes out longest first, so the last minutes are short tests on both workers rather than one long test on
# one: each test's seconds from a serial run (tests/durations.json, `make test-durations` rewrites it); a test not
# listed counts 5 s when slow, 0.1 s otherwise. Only the order depends on it, never a result.
DURATIONS = Path(__file__).with_name("durations.json")


def _longest_first(items: list[pytest.Item]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    def unit(item: pytest.Item) -> str:
        group = item.get_closest_marker("xdist_group")
        return group.args[0] if group else item.nodeid

    cost: dict[str, float] = {}
    for item in items:
        default = 5.0 if item.get_closest_marker("slow") else 0.1
        cost[unit(item)] = cost.get(unit(item), 0.0) + seconds.get(item.nodeid, default)
    first = {}
    for index, item in enumerate(items):
        first.setdefault(unit(item), index)
    # a stable sort: within a unit, the tests keep their file order
    items.sort(key=lambda item: (-cost[unit(item)], first[unit(item)]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With LYCHEE_TEST_DURATIONS=<file>, a serial run writes each test's seconds there (make test-durations)."""
    out = os.environ.get("LYCHEE_TEST_DURATIONS")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps([report.nodeid, report.duration]) + "\n")


@pytest.fixture(autouse=True)
def _the_fast_tier_starts_no_python_process(request, monkeypatch):
    """In a run that leaves the slow tests out (`make test-fast`), a test the rule above calls fast but that starts
    a Python module or script in a child process (`accelerate launch`, `kedro`, `mlflow`, a script) fails, naming
    what it started: the rule has missed a fixture or helper (one renamed by a refactor, say), and the fast tier
    would silently grow slow. A `python -c` snippet (a process that only sleeps, say) is let through. A full run
    (`make test`) is not watched."""
    if "not slow" not in (request.config.option.markexpr or "") or request.node.get_closest_marker("slow"):
        yield
        return
    import subprocess
    import sys

    started: list[str] = []
    original = subprocess.Popen.__init__

    def watched(self, args, *rest, **kwargs):
        command = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        if command and command[0] == sys.executable and command[1:2] != ["-c"]:
            started.append(" ".join(command)[:200])
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} is in the fast tier but started {started[0]!r}: add the fixture or "
                    "helper that starts it to SLOW_FIXTURES / PROCESS_STARTERS in tests/conftest.py", pytrace=False)
