"""Doctor phase D: parts of checkpoints saved across hosts whose host has gone silent.

Agents (``ckpt agent``) record a heartbeat for their host every few seconds, and savers
record every host of a save at its commit. A host not heard from for longer than the
``host_timeout_s`` setting is taken for gone: every part copy the catalog says its disk holds
is reported, with the other copies of that part (a peer's disk, the warm tier) or the news
that the checkpoint can no longer be loaded whole. Nothing is repaired: the host may come
back (its agent then goes on), and what to do with a lost part is a person's decision.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from ckptstore.ops.upkeep.doctor.run import DoctorRun
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState

__all__ = ["check_hosts"]

logger = logging.getLogger(__name__)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_hosts(job: DoctorRun, everything: list[Checkpoint]) -> None:
    """Report the part copies held by hosts silent for longer than ``host_timeout_s``."""
    store = job.store
    timeout = store.settings.host_timeout_s
    now = datetime.now(UTC)
    hosts = store.catalog.hosts()
    job.count("hosts", len(hosts))
    gone = {h.name: (now - h.last_seen).total_seconds() for h in hosts
            if (now - h.last_seen).total_seconds() > timeout}
    parted = {ck.id: ck for ck in everything
              if ck.parted and ck.state == CheckpointState.COMMITTED}
    if not gone or not parted:
        return
    for name, silent in sorted(gone.items()):
        held = store.catalog.parts_on(name, tier="hot",
                                      states=[ReplicaState.PRESENT, ReplicaState.DAMAGED])
        for ckpt_id, part in held:
            ck = parted.get(ckpt_id)
            if ck is None:
                continue
            others = [
                (f"{p.tier} on {p.stored_on}" if p.stored_on else p.tier)
                for p in store.catalog.parts(ck.id)
                if p.part == part.part and p.state == ReplicaState.PRESENT
                and not (p.tier == "hot" and p.stored_on == name)
            ]
            whole = [r.tier for r in ck.replicas if r.tier != "hot"
                     and r.state == ReplicaState.PRESENT]
            if whole:
                others.append(f"the complete {', '.join(whole)} copy")
            what = "its part" if part.part == name else f"the copy of {part.part}'s part"
            where = (f"other copies: {', '.join(sorted(set(others)))}" if others else
                     "no other copy of that part exists: the checkpoint cannot be loaded "
                     "whole unless the host comes back")
            job.find(
                "lost-part", ck.id,
                f"{ck.ref}: host {name} holds {what}, and was last heard from "
                f"{_age(silent)} ago (host_timeout_s = {timeout:.0f}); {where}. If {name} is "
                f"gone for good, archive the parts of the other hosts now (`ckpt archive`)",
                tier="hot",
            )
