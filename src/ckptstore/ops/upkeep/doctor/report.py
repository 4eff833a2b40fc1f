"""What a doctor run found: the kinds of finding, each finding, and the report."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FINDING_KINDS", "DoctorReport", "Finding"]

logger = logging.getLogger(__name__)

#: Every kind of finding, in report order.
FINDING_KINDS: tuple[str, ...] = (
    "dead-lease",
    "dead-pending",
    "stale-copying",
    "missing-replica",
    "damaged-replica",
    "zarr-metadata",
    "interrupted-delete",
    "orphan-data",
    "stray-temp",
    "lost-part",
)


@dataclass
class Finding:
    """One discrepancy between the catalog and the tiers.

    Attributes:
        kind: One of :data:`FINDING_KINDS`.
        subject: What it is about: a checkpoint id, a path or a tier key.
        detail: What is wrong, and what to do when it is not fixed automatically.
        tier: The tier concerned, if any.
        fixable: Whether ``fix=True`` repairs it.
        fixed: Whether this run repaired it.
        error: Why the repair failed, if it was attempted and failed.
    """

    kind: str
    subject: str
    detail: str
    tier: str | None = None
    fixable: bool = False
    fixed: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "kind": self.kind,
            "subject": self.subject,
            "detail": self.detail,
            "tier": self.tier,
            "fixable": self.fixable,
            "fixed": self.fixed,
            "error": self.error,
        }


@dataclass
class DoctorReport:
    """What :func:`doctor` found and (with ``fix``) repaired.

    Attributes:
        findings: Every finding, fixed or not.
        fix: Whether repairs were applied.
        checked: What was looked at: ``checkpoints``, ``replicas``, ``directories``, ``keys``.
    """

    findings: list[Finding] = field(default_factory=list)
    fix: bool = False
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def problems(self) -> list[Finding]:
        """Findings still standing after this run (not fixed)."""
        return [f for f in self.findings if not f.fixed]

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (any more)."""
        return not self.problems

    def of_kind(self, kind: str) -> list[Finding]:
        """Findings of one kind."""
        return [f for f in self.findings if f.kind == kind]

    def render(self) -> str:
        """Human-readable report, one line per finding."""
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.checked.items()))
        head = f"doctor checked {counts or 'nothing'}: "
        if not self.findings:
            return head + "catalog and storage agree"
        fixed = sum(1 for f in self.findings if f.fixed)
        lines = [head + f"{len(self.findings)} finding(s), {fixed} fixed"]
        order = {k: i for i, k in enumerate(FINDING_KINDS)}
        for f in sorted(self.findings, key=lambda f: (order.get(f.kind, 99), f.subject)):
            status = "fixed" if f.fixed else ("FIX FAILED" if f.error else
                                              ("fixable" if f.fixable else "manual"))
            where = f" [{f.tier}]" if f.tier else ""
            lines.append(f"  {f.kind:<18} {status:<10} {f.subject}{where}: {f.detail}"
                         + (f" ({f.error})" if f.error else ""))
        if not self.fix and any(f.fixable for f in self.findings):
            lines.append("run `ckpt doctor --fix` to apply the safe repairs")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "ok": self.ok,
            "fix": self.fix,
            "checked": dict(self.checked),
            "findings": [f.to_dict() for f in self.findings],
        }
