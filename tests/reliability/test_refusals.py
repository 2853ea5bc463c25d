"""Refused input ends `kedro run` in one line, as a user meets it on the command line (issue 32, items 3 and 4).

A bad parameter, data that cannot be read and a model that is nowhere print their one line last on the
terminal and exit non-zero; the traceback goes to info.log (`LYCHEE_VERBOSE=1` prints it); a bug in the
project's code keeps its traceback. The model source is checked before any data node runs, in seconds, with
the hub unreachable or switched off (`HF_HUB_OFFLINE=1`).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from project_runs import make_project_copy

MODEL = "vec-ai/lychee-rerank-mm"


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kedro(root: Path, *args: str, python: list[str] | None = None, **env: str) -> tuple[int, list[str], float]:
    """(exit code, terminal lines (stdout + stderr), seconds) of `kedro run ARGS` in `root`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING", "LYCHEE_", "HF_"))}
    full_env.update(KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
                    TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="", HF_HOME=str(root / "hf_home"), **env)
    start = time.monotonic()
    proc = subprocess.run([*(python or [sys.executable, "-m", "kedro"]), "run", *args], cwd=root, env=full_env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, (proc.stdout + proc.stderr).splitlines(), time.monotonic() - start


def _assert_refused_in_one_line(code: int, lines: list[str], root: Path, expected: str) -> None:
    text = "\n".join(lines)
    assert code != 0, text
    assert lines[-1].startswith("Error: ") and expected in lines[-1], text
    assert "Traceback" not in text and "╭" not in text, text  # neither Python's nor Rich's
    assert "Traceback" in (root / "info.log").read_text(), "the traceback belongs in the log file"


@pytest.fixture
def project(tmp_path) -> Path:
    return make_project_copy(tmp_path / "project")


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_a_model_that_is_nowhere_is_one_line_before_any_data_work(project, hub):
    """The README's real-model smoke command without network: refused in seconds, no node ran, no MLflow run."""
    env = {"HF_HUB_OFFLINE": "1"} if hub == "offline" else {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    code, lines, seconds = _kedro(project, "--pipelines", "smoke", "--params",
                                  f"model.name_or_path={MODEL},smoke.model.finetune=lora", **env)
    _assert_refused_in_one_line(code, lines, project, f"model '{MODEL}' (model.name_or_path) not found")
    last = lines[-1]
    assert f"no folder {project / MODEL}" in last and f"not in the Hugging Face cache {project / 'hf_home'}" in last
    assert ("HF_HUB_OFFLINE=1" if hub == "offline" else "unreachable") in last, last
    assert not [x for x in lines if "Running node" in x], "a node ran before the model was looked for"
    assert not list((project / "data").rglob("*.*")), "data was written"
    assert len(lines) <= 8, "\n".join(lines)
    assert seconds < 60, f"{seconds:.0f} s"  # the child processes' hub retries took minutes


def test_a_model_in_the_hub_cache_or_a_folder_is_found(tmp_path, monkeypatch):
    """The cache is looked in before the hub (offline too); a folder is taken as it is. (The settings
    huggingface_hub reads from HF_HOME / HF_HUB_OFFLINE when imported, set for this process's import.)"""
    from huggingface_hub import constants

    from lychee_pipeline.model_source import ModelNotFound, locate_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hub" / "models--lychee-test--cached-only"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    assert locate_model("lychee-test/cached-only") == f"in the Hugging Face cache {tmp_path / 'hub'}"
    assert locate_model(str(tmp_path)) == f"the folder {tmp_path.resolve()}"
    assert locate_model("builtin:tiny") == "a model built into the project"
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache .*HF_HUB_OFFLINE=1"):
        locate_model("lychee-test/never-downloaded")


def test_a_refused_parameter_is_one_line(project):
    """qlora on a machine without CUDA: the plan's one line, last, and nothing else of the error."""
    code, lines, _ = _kedro(project, "--pipelines", "full", "--params", "gpus=8,model.finetune=qlora")
    _assert_refused_in_one_line(code, lines, project, "model.finetune=qlora needs a CUDA GPU")
    assert len(lines) <= 8, "\n".join(lines)


def _cut_gzip(folder: Path) -> Path:
    folder.mkdir()
    lines = "".join(json.dumps({"query": f"red dress {i}", "pos_doc": {"text": "a red dress"},
                                "neg_docs": [{"text": "a blue hat"}]}) + "\n" for i in range(3000))
    data = gzip.compress(lines.encode())
    (folder / "records.jsonl.gz").write_bytes(data[: len(data) // 2])
    return folder


@pytest.mark.parametrize("case", ["gzip cut short", "no JSON lines files"])
def test_refused_data_is_one_line_after_the_node_that_read_it(project, tmp_path, case):
    if case == "gzip cut short":
        raw, expected = _cut_gzip(tmp_path / "raw"), "its gzip stream is corrupt or cut short"
    else:
        raw, expected = tmp_path / "raw", "no JSON lines files to read at data.raw_path="
        raw.mkdir()
        (raw / "notes.txt").write_text("not records\n")
    code, lines, _ = _kedro(project, "--pipelines", "data", "--params", f"data.raw_path={raw}")
    _assert_refused_in_one_line(code, lines, project, expected)
    failed = next(i for i, x in enumerate(lines) if "failed with error" in x)
    # Kedro's failed-node line and the message, MLflow's one closing line, the hint and the error line
    assert len(lines) - failed <= 6, "\n".join(lines[failed:])
    assert not [x for x in lines if "--from-nodes" in x], "a resume advice for refused input"


def test_the_traceback_of_a_refusal_is_shown_when_asked(project, tmp_path):
    code, lines, _ = _kedro(project, "--pipelines", "data", "--params", f"data.raw_path={_cut_gzip(tmp_path / 'raw')}",
                            LYCHEE_VERBOSE="1")
    text = "\n".join(lines)
    assert code != 0 and "Traceback" in text and "UnreadableData" in text, text


def test_a_bug_keeps_its_traceback(project):
    """A bug in the project's code (here injected into the model check) is not dressed as refused input."""
    inject = ("import lychee_pipeline.model_source as m; m.locate_model = lambda *a, **k: 1 / 0; "
              "from kedro.framework.cli import main; main()")
    code, lines, _ = _kedro(project, "--pipelines", "smoke", python=[sys.executable, "-c", inject])
    text = "\n".join(lines)
    assert code != 0 and "Traceback" in text and "ZeroDivisionError" in text, text
    assert not [x for x in lines if x.startswith("Error: ")], text


def test_a_registered_model_that_is_not_there_is_one_line(project, tmp_path):
    """The README's batch rerank before any `full` run registered a model: the versions there are, in one line."""
    candidates = tmp_path / "candidates.jsonl"
    candidates.write_text(json.dumps({"query": {"text": "red dress"},
                                      "docs": [{"doc_id": "a", "text": "a red dress"}]}) + "\n")
    code, lines, _ = _kedro(project, "--pipelines", "rerank", "--params",
                            f"rerank.input={candidates},rerank.model=models:/never-registered@champion")
    _assert_refused_in_one_line(code, lines, project, "models:/never-registered@champion: no registered model "
                                                      "'never-registered' in sqlite:///")


def test_a_parameter_error_of_any_node_is_a_refusal():
    """The typed parameters' one-line error (evaluation, registry, training) is refused input wherever it is raised
    (the plan's ValueErrors are wrapped by the parameter check before the run instead)."""
    from lychee_pipeline.runtime.errors import UserInputError, refusal_in
    from lychee_pipeline.evaluation.params import evaluation_params

    with pytest.raises(ValueError) as error:
        evaluation_params({"seed": "abc"})
    assert isinstance(error.value, UserInputError) and refusal_in(RuntimeError("node failed")) is None
    assert str(error.value).startswith("invalid parameter evaluation.seed: ")



def _numbered_corpus(folder: Path, records: int = 14, products: int = 7) -> Path:
    """Issue 32 item 6: a small shop whose documents carry an id per line, the same product texts again and
    again (record i: product i % 7 as positive, the next product as negative, pinned to train; two more pinned to
    test, for the run to evaluate). 28 doc_ids in training, but the negative draw compares by doc_id or content,
    and a record may use only the 5 products that are not its own positive or negative: a group of 8 needs 6
    drawn, so every record is short of one."""
    folder.mkdir()
    lines = [json.dumps({"id": f"r{i}", "query": f"query {i}", "split": "train" if i < records else "test",
                         "pos_doc": {"id": f"r{i}-pos", "text": f"product {i % products}"},
                         "neg_docs": [{"id": f"r{i}-neg", "text": f"product {(i + 1) % products}"}]})
             for i in range(records + 2)]
    (folder / "records.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_a_corpus_too_small_for_the_negative_draw_is_refused_before_launch(project, tmp_path):
    """What the draw can use, counted before any process starts: one line naming how many records are short,
    what a group needs and the setting to change (it passed the old count of distinct doc_ids, then failed
    inside the training processes with ShortGroupError and two tracebacks)."""
    raw = _numbered_corpus(tmp_path / "raw")
    code, lines, _ = _kedro(project, "--pipelines", "smoke", "--params", f"data.raw_path={raw}")
    _assert_refused_in_one_line(
        code, lines, project, "invalid parameter training.group_size=8: 14 of 14 training records cannot fill a "
                              "group with 7 negatives (group_size - 1)")
    last = lines[-1]
    assert "at most 7 for this data" in last and "a smaller training.group_size or more data" in last, last
    assert not list((project / "data" / "06_models").rglob("spec.json")), "a stage was launched"
    assert not list((project / "data" / "06_models").rglob("train.parquet")), "the table was exported"
    assert not [x for x in lines if "ShortGroupError" in x], "\n".join(lines)


def test_a_parameter_a_data_node_checks_is_one_line(project, tmp_path):
    """Issue 32: a user parameter checked inside a node (here data_processing.ingestion.max_text_chars, checked by
    the ingestion node) is refused input too: its one line, not a traceback around a plain ValueError."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "records.jsonl").write_text(json.dumps({"query": "red dress", "pos_doc": {"text": "a red dress"}}) + "\n")
    code, lines, _ = _kedro(project, "--pipelines", "data", "--params",
                            f"data.raw_path={raw},data_processing.ingestion.max_text_chars=0")
    _assert_refused_in_one_line(code, lines, project, "invalid parameter data_processing.ingestion.max_text_chars: "
                                                      "must be >= 1, got 0")
    assert not [x for x in lines if "--from-nodes" in x], "a resume advice for refused input"


def test_a_run_that_evaluates_stops_at_the_split_when_the_test_split_has_no_query(project, tmp_path):
    """Own data too small for a test query (a newcomer's: training ran, then the evaluation failed with a
    traceback): `smoke` stops in one line as the split comes out, before training; `data` only warns."""
    raw = tmp_path / "raw"
    raw.mkdir()
    records = [{"query": f"red dress {i}", "pos_doc": {"text": f"a red dress, style {i}"}, "split": "train",
                "neg_docs": [{"text": f"a blue hat {i}"}, {"text": f"green shoes {i}"}]} for i in range(6)]
    (raw / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, lines, _ = _kedro(project, "--pipelines", "smoke", "--params", f"data.raw_path={raw}")
    _assert_refused_in_one_line(code, lines, project, "the test split has no query to evaluate on (6 queries in all")
    assert "data_processing.split.ratios.test" in lines[-1]
    ran = [x.split("Running node: ", 1)[1].split(":")[0] for x in lines if "Running node: " in x]
    assert "split_by_query_group" in ran, ran
    assert not [x for x in ran if x.endswith(("export_training_table", "run_stage"))], ran  # no table, no stage
    assert not [x for x in lines if "--from-nodes" in x], "a resume advice for refused input"
    code, lines, _ = _kedro(project, "--pipelines", "data", "--params", f"data.raw_path={raw}")
    assert code == 0 and [x for x in lines if "no query in test" in x], "\n".join(lines)
