"""Offline dependency audit: the locked dependency set against a snapshot of the PyPA advisory database.

`pip-audit` asks a live service (PyPI's JSON API, or OSV) for each package. Where neither answers, as on
this project's CI machines, this script gives the same answer from data kept in the repository:

    python security/audit.py                      # audit constraints.txt against security/pypa-advisories.json
    python security/audit.py --installed          # audit what is installed in this interpreter instead
    python security/audit.py --extract DIR --source "pypa/advisory-database@<commit> (<date>)"
                                                  # rebuild the snapshot from a checkout's vulns/ folder

The snapshot keeps, for every advisory of every locked package, only its id, aliases and affected versions
(facts, no advisory text), plus the names of every package the database covers, so a package added to the
lock that the snapshot never looked at is reported instead of passing unseen.
Exit status: 0 no unexplained finding, 1 findings (or stale snapshot), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_LOCK = ROOT / "constraints.txt"
DEFAULT_SNAPSHOT = HERE / "pypa-advisories.json"
DEFAULT_IGNORE = HERE / "ignored.toml"
BUILD_TAG = re.compile(r"-[A-Za-z][A-Za-z0-9.]*$")
PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


@dataclass(frozen=True)
class Finding:
    """One advisory that covers one locked package version."""

    package: str
    version: str
    advisory: str
    aliases: tuple[str, ...]
    fixed: tuple[str, ...]


def read_lock(path: Path) -> dict[str, str]:
    """Canonical package name -> pinned version, from a `name==version` requirements/constraints file."""
    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.split("#", 1)[0].strip()
        if not stripped:
            continue
        match = PIN.match(stripped)
        if match is None:
            raise ValueError(f"{path}:{number}: not a `name==version` pin: {line!r}")
        pins[canonicalize_name(match.group(1))] = match.group(2).split("+", 1)[0]  # local tags (+cpu) are builds
    return pins


def installed_set(skip: set[str]) -> dict[str, str]:
    """Canonical package name -> version for every distribution in this interpreter, minus `skip`."""
    found = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name not in skip:
            found[name] = dist.version.split("+", 1)[0]
    return found


def _version(raw: str) -> Version | None:
    """PEP 440 version; a bound such as `2.6.0-cu124` or `2.6.0-NA` (a build tag, not PEP 440) reads as `2.6.0`."""
    for candidate in (raw, BUILD_TAG.sub("", raw)):
        try:
            return Version(candidate)
        except InvalidVersion:
            continue
    return None


def _in_events(version: Version, events: list[dict[str, str]]) -> bool:
    """OSV ECOSYSTEM range semantics: walk the events in version order, entering at introduced, leaving at fixed."""
    points = []
    for event in events:
        for kind, raw in event.items():
            if kind in ("introduced", "fixed", "last_affected"):
                point = Version("0") if raw == "0" else _version(raw)
                if point is None:
                    return True  # a bound that cannot be read cannot rule the version out: report it
                points.append((point, kind != "introduced", kind))
    affected = False
    for point, _, kind in sorted(points):
        if kind == "introduced" and version >= point:
            affected = True
        elif kind == "fixed" and version >= point:
            affected = False
        elif kind == "last_affected" and version > point:
            affected = False
    return affected


def is_affected(version: str, advisory: dict) -> bool:
    """True when `version` is listed in the advisory's versions or falls inside one of its ECOSYSTEM ranges."""
    if version in advisory.get("versions", ()):
        return True
    parsed = _version(version)
    return parsed is not None and any(_in_events(parsed, events) for events in advisory.get("ranges", ()))


def audit(pins: dict[str, str], snapshot: dict) -> tuple[list[Finding], list[str]]:
    """Findings for the pinned set, and the pinned packages the snapshot's database covers but did not extract."""
    covered = set(snapshot["packages_in_database"])
    extracted = snapshot["advisories"]
    findings, unseen = [], []
    for name, version in sorted(pins.items()):
        if name in covered and name not in extracted:
            unseen.append(name)
            continue
        for advisory in extracted.get(name, ()):
            if is_affected(version, advisory):
                findings.append(
                    Finding(name, version, advisory["id"], tuple(advisory["aliases"]), tuple(advisory["fixed"]))
                )
    return findings, unseen


def read_ignored(path: Path) -> dict[str, str]:
    """Advisory id -> the documented reason it is accepted (security/ignored.toml, mirrored in docs/reliability.md)."""
    if not path.exists():
        return {}
    table = tomllib.loads(path.read_text()).get("ignore", {})
    missing = [vid for vid, entry in table.items() if not str(entry.get("reason", "")).strip()]
    if missing:
        raise ValueError(f"{path}: every ignored advisory needs a reason; missing for {missing}")
    return {vid: entry["reason"] for vid, entry in table.items()}


def extract(vulns_dir: Path, pins: dict[str, str], source: str) -> dict:
    """Build the snapshot: all advisories of the pinned packages, reduced to ids, aliases and affected versions."""
    import yaml  # PyYAML comes with kedro; only the rebuild needs it

    advisories: dict[str, list[dict]] = {}
    covered: set[str] = set()
    for folder in sorted(p for p in vulns_dir.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*.yaml")):
            record = yaml.safe_load(path.read_text())
            if record.get("withdrawn"):
                continue
            for affected in record.get("affected", ()):
                package = affected.get("package", {})
                if package.get("ecosystem") != "PyPI":
                    continue
                name = canonicalize_name(package["name"])
                covered.add(name)
                if name not in pins:
                    continue
                ranges = [r["events"] for r in affected.get("ranges", ()) if r.get("type") == "ECOSYSTEM"]
                entry = {
                    "id": record["id"],
                    "aliases": sorted(record.get("aliases") or ()),
                    "modified": str(record.get("modified", "")),
                    "ranges": ranges,
                    "fixed": sorted({e["fixed"] for events in ranges for e in events if "fixed" in e}),
                }
                if not ranges:  # no version ranges: only the explicit list says what is affected
                    entry["versions"] = [str(v) for v in affected.get("versions", ())]
                advisories.setdefault(name, []).append(entry)
    for name in pins:
        if name in covered:
            advisories.setdefault(name, [])
    return {
        "source": source,
        "license": "PyPA advisory database data, CC-BY 4.0 (https://github.com/pypa/advisory-database)",
        "packages_in_database": sorted(covered),
        "advisories": {name: sorted(entries, key=lambda e: e["id"]) for name, entries in sorted(advisories.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK, help="pinned dependency set (default: constraints.txt)")
    parser.add_argument("--installed", action="store_true", help="audit this interpreter's installed set instead")
    parser.add_argument("--snapshot", type=Path, default=DEFAULT_SNAPSHOT)
    parser.add_argument("--ignore", type=Path, default=DEFAULT_IGNORE)
    parser.add_argument("--extract", type=Path, metavar="VULNS_DIR", help="rebuild --snapshot from an OSV vulns/ folder")
    parser.add_argument("--source", default="", help="with --extract: where the data came from (repo@commit, date)")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")
    args = parser.parse_args(argv)

    pins = installed_set({"lychee-pipeline"}) if args.installed else read_lock(args.lock)
    if args.extract is not None:
        if not args.source:
            parser.error("--extract needs --source naming the database and its commit")
        # the lock and this interpreter both: `--installed` audits then need no second rebuild
        snapshot = extract(args.extract, read_lock(args.lock) | installed_set({"lychee-pipeline"}), args.source)
        args.snapshot.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
        count = sum(len(v) for v in snapshot["advisories"].values())
        print(f"wrote {args.snapshot}: {count} advisories over {len(snapshot['advisories'])} locked packages")
        return 0

    snapshot = json.loads(args.snapshot.read_text())
    ignored = read_ignored(args.ignore)
    findings, unseen = audit(pins, snapshot)
    open_findings = [f for f in findings if f.advisory not in ignored and not set(f.aliases) & set(ignored)]
    if args.json:
        print(json.dumps({"findings": [f.__dict__ for f in findings], "unseen": unseen}, indent=1))
    else:
        print(f"audited {len(pins)} pinned packages against {snapshot['source']}")
        for f in findings:
            state = "accepted" if f not in open_findings else "OPEN"
            fix = ", ".join(f.fixed) or "no fixed release"
            print(f"  {state:8} {f.package}=={f.version}  {f.advisory} {' '.join(f.aliases)}  (fixed in: {fix})")
        for name in unseen:
            print(f"  STALE    {name}: covered by the database but not in the snapshot; rebuild it with --extract")
        print(f"{len(findings)} finding(s), {len(findings) - len(open_findings)} accepted in {args.ignore.name}, "
              f"{len(open_findings)} open, {len(unseen)} package(s) not in the snapshot")
    return 1 if open_findings or unseen else 0


if __name__ == "__main__":
    sys.exit(main())
