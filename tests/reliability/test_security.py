"""Security: no remote code, tensors-only loading, image paths confined, local-only UIs, credentials never
logged to MLflow, and a dependency audit."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from lychee_pipeline.data.images import Resolver
from lychee_pipeline.reranker.model import ModelConfig

PROJECT = Path(__file__).resolve().parents[2]
SRC = PROJECT / "src" / "lychee_pipeline"
AUDIT = PROJECT / "security" / "audit.py"
CHILD_ENV = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "1", "MLFLOW_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


def test_trust_remote_code_refused():
    with pytest.raises(ValueError, match="trust_remote_code=True is not allowed"):
        ModelConfig(name_or_path="builtin:tiny", trust_remote_code=True)
    # and in the pipeline, at plan time (one line, before a process starts): see test_bad_inputs.py


def test_no_unsafe_deserialisation_in_the_package():
    """No pickle, no torch.load without weights_only, no remote code anywhere in our source."""
    offenders = []
    for path in SRC.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bimport pickle\b|\bpickle\.loads?\(|\bcloudpickle\b|\bimport dill\b"
                         r"|weights_only\s*=\s*False|[(,]\s*trust_remote_code\s*=\s*True"
                         r"|(?<![.\w])(eval|exec)\(", code):
                offenders.append(f"{path.relative_to(PROJECT)}:{number}: {line.strip()}")
            if re.search(r"torch\.load\(", code) and "weights_only=True" not in code:
                offenders.append(f"{path.relative_to(PROJECT)}:{number}: {line.strip()}")
    assert offenders == []
    assert '"use_safetensors": True' in (SRC / "reranker" / "model.py").read_text()
    assert 'load_kwargs={"weights_only": True}' in (SRC / "training" / "train.py").read_text()


class Payload:
    """A pickled object whose unpickling would create `marker` (it stands for any code a pickle can run)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def test_a_resumed_stage_refuses_a_pickled_object_in_its_checkpoint(tmp_path, reliability_table, no_fault_env):
    """The project's resume path (training/checkpoints.find_resumable, then Accelerate's load_state with
    weights_only) on a checkpoint whose optimizer state was swapped for a pickled object and its manifest rewritten
    to match, as someone who can write the run folder would: the checksums pass, the loader refuses the object and
    the stage fails before training; the object's code never runs. Two launches."""
    from reliability_helpers import stage_plan

    from lychee_pipeline.runtime.launcher import StageFailed
    from lychee_pipeline.training import checkpoints
    from lychee_pipeline.training.planning import run_training_stage

    plan = stage_plan(tmp_path, max_steps=3, checkpoint_every=1)
    stage_dir = Path(plan.run_dir) / "stage_1cpu_final"
    no_fault_env.setenv("LYCHEE_FAULT", "during_checkpoint_2")  # killed while writing checkpoint 2: 1 is published
    with pytest.raises(StageFailed, match="exited with code"):
        run_training_stage(reliability_table, plan, devices=1, final=True)
    checkpoint = stage_dir / "checkpoints" / "checkpoint-1"
    marker = tmp_path / "the_pickle_ran"
    torch.save({"state": Payload(marker), "param_groups": []}, checkpoint / "optimizer.bin")
    manifest = json.loads((checkpoint / checkpoints.MANIFEST).read_text())
    (checkpoint / checkpoints.MANIFEST).write_text(json.dumps({**manifest, "files": checkpoints.file_digests(checkpoint)}))
    assert checkpoints.find_resumable(checkpoint.parent)[0] == checkpoint  # the checksums are no defence here

    no_fault_env.delenv("LYCHEE_FAULT")
    with pytest.raises(StageFailed, match="exited with code"):
        run_training_stage(reliability_table, stage_plan(tmp_path, max_steps=3, checkpoint_every=1, resume=True),
                           devices=1, final=True)
    log = (stage_dir / "launch.log").read_text()
    assert "Weights only load failed" in log and "makedirs" in log, log[-3000:]
    assert not marker.exists()


def test_symlink_escaping_the_image_roots_is_refused(tmp_path):
    root, outside = tmp_path / "images", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"x")
    (root / "ok.png").write_bytes(b"x")
    (root / "link.png").symlink_to(outside / "secret.png")  # a file link pointing out
    (root / "sub").symlink_to(outside, target_is_directory=True)  # a folder link pointing out
    (root / "inner.png").symlink_to(root / "ok.png")  # a link that stays inside is fine
    resolver = Resolver([str(root)])
    assert resolver.resolve("ok.png")[0] == str((root / "ok.png").resolve())
    assert resolver.resolve("inner.png")[0] == str((root / "ok.png").resolve())
    for ref in ("link.png", "sub/secret.png", str(root / "link.png"), str(root / "sub" / "secret.png")):
        path, reason = resolver.resolve(ref)
        assert path is None and reason == f"path escapes the image roots: {ref}"


def test_uis_bind_to_loopback_by_default():
    mlflow_conf = yaml.safe_load((PROJECT / "conf" / "base" / "mlflow.yml").read_text())
    assert mlflow_conf["ui"]["host"] == "127.0.0.1"
    makefile = (PROJECT / "Makefile").read_text()
    for command in ("kedro viz run", "kedro mlflow ui"):
        lines = [line for line in makefile.splitlines() if command in line]
        assert lines and all("--host 127.0.0.1" in line for line in lines), lines


def test_credentials_are_git_ignored():
    if shutil.which("git") is None or not (PROJECT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["conf/local/credentials.yml", "conf/base/credentials.yml", "conf/local/mlflow.yml"]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=PROJECT, capture_output=True, text=True).stdout
    assert ignored.split() == paths


SECRET = "s3cr3t-DO-NOT-LOG-7f3a9c"

SESSION = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    project = Path(sys.argv[1])
    bootstrap_project(project)
    with KedroSession.create(project_path=project, runtime_params={
            "demo_data.n_products": 12, "demo_data.n_records": 30}) as session:
        session.run(pipeline_name="demo_data")
""")


def test_credentials_never_logged_as_mlflow_params(tmp_path):
    """A real KedroSession (kedro-mlflow hooks on) in a copy of the project with a credential configured."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(PROJECT / "conf", project / "conf", ignore=shutil.ignore_patterns("credentials*"))
    shutil.copy(PROJECT / "pyproject.toml", project / "pyproject.toml")
    (project / "src").mkdir()  # the package itself is installed (editable); kedro wants the folder
    (project / "conf" / "local").mkdir(exist_ok=True)
    (project / "conf" / "local" / "credentials.yml").write_text(yaml.safe_dump(
        {"mlflow_env": {"MLFLOW_TRACKING_PASSWORD": SECRET}, "s3": {"key": "AKIA", "secret": SECRET}}))
    run = subprocess.run([sys.executable, "-c", SESSION, str(project)], cwd=project, env=CHILD_ENV,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert SECRET not in run.stdout + run.stderr  # not in the log either

    db = project / "mlflow.db"
    assert db.is_file()
    with sqlite3.connect(db) as conn:
        runs = conn.execute("SELECT run_uuid FROM runs").fetchall()
        params = conn.execute("SELECT key, value FROM params").fetchall()
        tags = conn.execute("SELECT key, value FROM tags").fetchall()
    assert runs and params  # the run was logged, with its parameters
    assert any(key.startswith("demo_data") for key, _ in params)
    for key, value in params + tags:
        assert SECRET not in key and SECRET not in (value or ""), key
    assert SECRET.encode() not in db.read_bytes()  # nowhere in the store at all
    for path in project.rglob("*"):
        if path.is_file() and "credentials" not in path.name:
            assert SECRET.encode() not in path.read_bytes(), path


def _load_audit():
    spec = importlib.util.spec_from_file_location("dependency_audit", AUDIT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dependency_audit"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run_audit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AUDIT), *args], capture_output=True, text=True, env=CHILD_ENV)


def test_offline_audit_of_the_lock_and_of_what_is_installed():
    """The locked set (constraints.txt) and this interpreter's installed set have no advisory in the committed
    PyPA snapshot that security/ignored.toml does not explain, and what runs is what the lock says."""
    audit = _load_audit()
    locked = audit.read_lock(AUDIT.parent.parent / "constraints.txt")
    installed = audit.installed_set({"lychee-pipeline"})
    drift = {name: (version, installed.get(name)) for name, version in locked.items()
             if name in installed and installed[name] != version}
    assert drift == {}, f"installed versions differ from constraints.txt (make install, or make lock): {drift}"
    for args in ((), ("--installed",)):
        run = _run_audit(*args)
        assert run.returncode == 0, run.stdout + run.stderr
        assert re.search(r"audited \d+ pinned packages", run.stdout), run.stdout


def test_offline_audit_reports_known_vulnerable_pins(tmp_path):
    """The same command fails on pins the snapshot knows to be vulnerable, names the advisory and the fix,
    accepts one only with a written reason, and flags a dependency the snapshot never extracted."""
    lock = tmp_path / "lock.txt"
    lock.write_text("torch==2.5.1+cpu  # CVE-2025-32434: torch.load weights_only bypass, fixed in 2.6.0\nnumpy==2.0.0\n")
    run = _run_audit("--lock", str(lock), "--json", "--ignore", str(tmp_path / "none.toml"))
    assert run.returncode == 1, run.stdout + run.stderr
    findings = json.loads(run.stdout)["findings"]
    hit = [f for f in findings if "CVE-2025-32434" in f["aliases"]]
    assert hit and hit[0]["package"] == "torch" and hit[0]["version"] == "2.5.1" and "2.6.0" in hit[0]["fixed"]
    assert all(f["package"] == "torch" for f in findings)  # numpy 2.0.0 has no advisory in the snapshot

    ignore = tmp_path / "ignored.toml"
    ignore.write_text("".join(f'[ignore."{f["advisory"]}"]\nreason = "test: accepted"\n' for f in findings))
    assert _run_audit("--lock", str(lock), "--ignore", str(ignore)).returncode == 0
    ignore.write_text(f'[ignore."{findings[0]["advisory"]}"]\nreason = ""\n')
    refused = _run_audit("--lock", str(lock), "--ignore", str(ignore))
    assert refused.returncode != 0 and "needs a reason" in refused.stderr

    lock.write_text("django==1.2\n")  # in the database, never locked here, so never extracted
    stale = _run_audit("--lock", str(lock))
    assert stale.returncode == 1 and "STALE    django" in stale.stdout


def test_offline_audit_range_semantics():
    """OSV ECOSYSTEM ranges: introduced/fixed/last_affected in version order, build-tag bounds read as their
    release, an unreadable bound reported rather than trusted."""
    audit = _load_audit()
    ranged = {"ranges": [[{"introduced": "1.0"}, {"fixed": "1.4"}, {"introduced": "2.0"}, {"last_affected": "2.1"}]]}
    assert [v for v in ("0.9", "1.0", "1.3.9", "1.4", "1.9", "2.0", "2.1", "2.1.1") if audit.is_affected(v, ranged)] \
        == ["1.0", "1.3.9", "2.0", "2.1"]
    tagged = {"ranges": [[{"introduced": "0"}, {"last_affected": "2.6.0-cu124"}]]}
    assert audit.is_affected("2.6.0", tagged) and not audit.is_affected("2.13.0", tagged)
    assert audit.is_affected("9.9", {"ranges": [[{"introduced": "0"}, {"fixed": "not a version"}]]})
    assert audit.is_affected("0.3", {"ranges": [], "versions": ["0.3"]})
    assert not audit.is_affected("0.4", {"ranges": [], "versions": ["0.3"]})


@pytest.mark.online
def test_dependency_audit():
    """pip-audit over the installed (pinned) dependency set against the live service. Not in the default run
    (no service answers in CI; the offline audit above covers the same set there): `pytest -m online`, or
    `make audit`. Where it is asked for, an unreachable service fails it. Accepted findings: security/ignored.toml."""
    audit = shutil.which("pip-audit", path=str(Path(sys.executable).parent)) or shutil.which("pip-audit")
    if audit is None:
        pytest.fail("pip-audit is not installed (pip install pip-audit; it is in the dev extra)")
    ignored = _load_audit().read_ignored(AUDIT.parent / "ignored.toml")  # id -> why it does not apply here
    command = [audit, "--progress-spinner", "off", "-f", "json", "--skip-editable"]
    for vuln in ignored:
        command += ["--ignore-vuln", vuln]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=CHILD_ENV)
    except subprocess.TimeoutExpired:
        pytest.fail("pip-audit: the vulnerability service did not answer within 240 s")
    out = run.stdout.strip()
    if not out.startswith("{"):
        if re.search(r"Connection|Max retries|NameResolution|timed out|Temporary failure|SSLError", run.stderr):
            pytest.fail(f"pip-audit: vulnerability service unreachable: {run.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip-audit failed: {run.stderr[-2000:]}")
    report = json.loads(out)
    deps = report["dependencies"]
    audited = [d for d in deps if "skip_reason" not in d]
    if not audited:
        reasons = {d["skip_reason"].split(":")[0] for d in deps}
        pytest.fail(f"pip-audit: vulnerability service unreachable (no package could be looked up: {reasons})")
    found = {f"{d['name']}=={d['version']}": [v["id"] for v in d.get("vulns", [])] for d in audited if d.get("vulns")}
    assert found == {}, f"vulnerable dependencies (fix the pin or document in docs/reliability.md): {found}"
