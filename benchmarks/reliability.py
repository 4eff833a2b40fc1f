"""Run the reliability suite's figure-producing scenarios and print what was survived
(what ``make reliability`` runs).

The suite (``tests/reliability``) injects real faults: SIGKILL at every save fault point and
at seeded random moments, kills during archive / prune / tier moves / restore, a full disk,
damaged files, an S3 server dying or throttling (503 SlowDown) mid-transfer, short reads,
concurrent savers/pruners/archivers/restorers on SQLite and PostgreSQL, and hostile inputs.
With ``CKPT_RELIABILITY_FULL=1`` (the default here) it runs the full matrix: >= 30 seeded
random kill points on ~100 MB saves, every tier kill point, 20 s concurrency windows.

Each test records its figures as one JSON line in ``$CKPT_RELIABILITY_REPORT``; this script
collects them into one table:

* kill points and runs survived (save path, and archive/prune/tier moves/restore),
* faults injected per kind,
* concurrent workers x seconds on each catalog backend,
* bad inputs tried,

each with ``lost: 0`` or the failing tests.

Usage::

    python benchmarks/reliability.py [--quick] [--only MODULE] [--json OUT] [-- PYTEST ARGS...]

Exit status: pytest's (0 when every scenario held).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["SECTIONS", "collect", "main", "render"]

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "reliability"


#: Table sections by test module, in display order.
SECTIONS = {
    "test_crash_save": "SIGKILL during save",
    "test_crash_tiers": "SIGKILL in archive/prune/move/restore",
    "test_storage_faults": "storage faults injected",
    "test_concurrency": "concurrency and races",
    "test_security": "bad inputs (security)",
    "test_signing_bundle": "signatures and hostile bundles",
    "test_hostile_remote": "hostile or overlapping remotes",
    "test_doctor": "doctor (catalog vs storage)",
    "test_read_repair": "damaged copies under reads (read repair)",
    "test_cli": "CLI",
}


def _module(test: str) -> str:
    return test.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def collect(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold the per-test records (outcomes and figures) into the table's sections.

    Args:
        lines: JSON records: ``{"test", "outcome", "reason"}`` for every test and
            ``{"test", "figures"}`` for tests that counted what they injected.

    Returns:
        ``{"sections": {module: {...}}, "failed": [...], "known_bugs": [...]}``.
    """
    sections: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    known: list[str] = []
    for rec in lines:
        section = sections.setdefault(_module(rec["test"]), {
            "tests": 0, "passed": 0, "xfailed": 0, "skipped": 0, "failed": [],
            "figures": defaultdict(int), "details": {},
        })
        if "outcome" in rec:
            section["tests"] += 1
            outcome = rec["outcome"]
            if outcome in ("passed", "xfailed", "skipped"):
                section[outcome] += 1
            else:
                section["failed"].append(rec["test"])
                failed.append(rec["test"])
            if outcome == "xfailed":
                known.append(f"{rec['test'].split('::')[-1]}: {rec.get('reason', '')}")
            continue
        for key, value in rec.get("figures", {}).items():
            if key == "seconds":
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                section["figures"][key] += value
            elif isinstance(value, dict) and all(isinstance(v, int | float)
                                                 for v in value.values()):
                if key.startswith(("concurrency_", "manifest_")) or "outcomes" in key:
                    section["details"].setdefault(key, {}).update(value)
                else:
                    target = section["figures"].setdefault(key, defaultdict(int))
                    for k, v in value.items():
                        target[k] += v
            else:
                section["details"][key] = value
    return {"sections": sections, "failed": failed, "known_bugs": known}


def _summary(module: str, section: dict[str, Any]) -> str:
    f = section["figures"]
    if module == "test_crash_save":
        named, random_kills = f.get("kill_points", 0), f.get("random_kills", 0)
        late = f.get("random_kills_after_save", 0)
        return (f"{named + random_kills + late} kill points ({named} named, {random_kills} "
                f"seeded random, {late} after the save); {f.get('runs_survived', 0)} runs "
                f"survived, {f.get('committed_before_kill', 0)} had committed")
    if module == "test_crash_tiers":
        return f"{f.get('kill_points', 0)} kill points, {f.get('runs_survived', 0)} runs survived"
    if module == "test_storage_faults":
        faults = f.get("faults", {})
        return ", ".join(f"{k} x{v}" for k, v in sorted(faults.items())) or "-"
    if module == "test_concurrency":
        parts = []
        for backend in ("sqlite", "postgresql"):
            c = section["details"].get(f"concurrency_{backend}")
            if c:
                parts.append(f"{backend}: {c.get('workers', 0)} workers x "
                             f"{c.get('seconds', 0):.0f} s, {c.get('saves', 0)} saves, "
                             f"{c.get('pruned', 0)} pruned, {c.get('archived', 0)} archived, "
                             f"{c.get('restored_loads', 0)} restored+loaded")
        parts.append(f"{f.get('same_step_races', 0)} same-(run, step) saves, "
                     f"{f.get('prune_restore_races', 0)} restores racing prune, "
                     f"{f.get('archive_races', 0)} double archives")
        return "; ".join(parts)
    if module == "test_read_repair":
        damage = f.get("damaged_copies", {})
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(damage.items())) or "-"
        return (f"{sum(damage.values())} damaged copies ({kinds}); "
                f"{f.get('reads_served', 0)} reads served exact from the next copy")
    if module == "test_hostile_remote":
        return (f"{f.get('forged_chunks_refused', 0)} forged equal-crc32c chunks refused; "
                f"{f.get('overlaps_refused_at_add', 0)} overlapping tiers refused at add, "
                f"{f.get('overlaps_refused_at_use', 0)} at use; "
                f"{f.get('vanished_mid_pull', 0)} pulls cut by a vanishing remote; "
                f"{f.get('catalog_lies', 0)} catalog lies; {f.get('prunes', 0)} prunes around "
                f"{f.get('syncs_after_prunes', 0)} syncs ({f.get('revived', 0)} revived, "
                f"{f.get('left_pruned_there', 0)} left pruned there)")
    if module in ("test_security", "test_signing_bundle"):
        text = f"{f.get('bad_inputs', 0)} bad inputs tried"
        manifests = {k.removeprefix("manifest_"): v for k, v in section["details"].items()
                     if k.startswith("manifest_")}
        if manifests:
            text += "; hostile manifests: " + ", ".join(
                f"{k} {v.get('cpu_s', '?')}s/{v.get('rss_growth_mb', '?')}MiB"
                for k, v in sorted(manifests.items()))
        return text
    return f"{section['tests']} checks"


def render(figures: dict[str, Any]) -> str:
    """The summary table as text: one row per area, ``lost: 0`` or the failed tests."""
    rows: list[tuple[str, str, str]] = []
    for module, label in SECTIONS.items():
        section = figures["sections"].get(module)
        if section is None:
            continue
        if section["failed"]:
            result = "FAILED: " + ", ".join(t.split("::")[-1] for t in section["failed"][:3])
        else:
            result = "lost: 0"
            if section["xfailed"]:
                result += f" ({section['xfailed']} known bug(s))"
        rows.append((label, _summary(module, section), result))
    width = max((len(r[0]) for r in rows), default=10)
    lines = [f"{'scenario':<{width}}  result                      what was injected / survived",
             "-" * (width + 100)]
    lines += [f"{a:<{width}}  {c:<27} {b}" for a, b, c in rows]
    if figures["known_bugs"]:
        lines.append("\nknown bugs (xfail, reported for fixing):")
        lines += [f"  - {bug}" for bug in figures["known_bugs"]]
    if figures["failed"]:
        lines.append(f"\n{len(figures['failed'])} test(s) FAILED: "
                     + ", ".join(figures["failed"][:10]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the suite, print the table; return pytest's exit status."""
    p = argparse.ArgumentParser(description="Run the reliability suite and print its table.")
    p.add_argument("--quick", action="store_true",
                   help="the default (sampled) matrix instead of CKPT_RELIABILITY_FULL=1")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    p.add_argument("--only", choices=sorted(SECTIONS), metavar="MODULE",
                   help="run only this module of the suite (e.g. test_hostile_remote)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    env = dict(os.environ)
    if not args.quick:
        env["CKPT_RELIABILITY_FULL"] = "1"
    with tempfile.TemporaryDirectory(prefix="ckpt-reliability-") as tmp:
        report = Path(tmp) / "figures.jsonl"
        env["CKPT_RELIABILITY_REPORT"] = str(report)
        target = SUITE / f"{args.only}.py" if args.only else SUITE
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--basetemp={Path(tmp) / 'pytest'}", str(target), *args.pytest_args]
        print(f"running {' '.join(cmd[1:])} (CKPT_RELIABILITY_FULL="
              f"{env.get('CKPT_RELIABILITY_FULL', '0')})", flush=True)
        started = time.perf_counter()
        code = subprocess.run(cmd, env=env, cwd=REPO, check=False).returncode
        elapsed = time.perf_counter() - started
        lines = []
        if report.exists():
            lines = [json.loads(line) for line in report.read_text().splitlines() if line]
    figures = collect(lines)
    figures["seconds"] = round(elapsed, 1)
    figures["pytest_exit"] = code
    print(f"\nreliability suite: {elapsed:.0f} s, pytest exit {code}\n")
    print(render(figures))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
