"""Handing a run's context back: how to reproduce a checkpoint, and what differs.

* :func:`how_to_reproduce`: the "how to reproduce" section of ``ckpt show`` (commit, dirty
  flag, command, config, environment summary, notes).
* :func:`write_recipe`: ``ckpt reproduce REF --dir D`` writes ``D/reproduce.sh`` (clone and
  check out the commit, apply the recorded change, check the environment against the lock,
  restore the checkpoint, run the recorded command with ``CKPT_RESUME`` naming the
  checkpoint), ``D/change.patch``, ``D/requirements.txt`` and ``D/context.json``.
* :func:`check_against`: ``--check``, every difference between the recorded context and
  this checkout and environment.
* :func:`diff_contexts`: ``ckpt runs diff A B``.

Blobs are read through :meth:`ckptstore.catalog.Catalog.context_blob`, which checks each
against its digest.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstore.capture import capture_context, distribution_lock
from ckptstore.core import StoreCore
from ckptstore.durable import replace_file
from ckptstore.errors import CheckpointNotFoundError, CkptError, ConfigError
from ckptstore.records import Checkpoint, RunContext

__all__ = [
    "RESUME_ENV",
    "Difference",
    "check_against",
    "context_for",
    "diff_contexts",
    "how_to_reproduce",
    "lock_versions",
    "write_recipe",
]


#: Set by a recipe (:func:`write_recipe`) to the id of the checkpoint the run resumes from;
#: ``CheckpointManager.restore_latest`` loads that one instead of the run's newest.
RESUME_ENV = "CKPT_RESUME"


@dataclass(frozen=True)
class Difference:
    """One difference between two contexts: where (``code.commit``, ``package.torch``,
    ``config.lr``, ...), the first value and the second."""

    field: str
    a: Any
    b: Any

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"field": self.field, "a": self.a, "b": self.b}


def context_for(core: StoreCore, ref: str) -> tuple[Checkpoint | None, RunContext]:
    """The context of a checkpoint reference, or a run's newest context for a run name.

    Raises:
        CheckpointNotFoundError: If nothing resolves, or no context was recorded.
    """
    ck: Checkpoint | None = None
    if "@" in ref or _looks_like_id(ref) or not _is_run(core, ref):
        ck = core.catalog.get(ref)
        ctx = core.catalog.context_of(ck)
        run = ck.run
    else:
        contexts = core.catalog.run_contexts(ref)
        ctx = contexts[-1] if contexts else None
        run = ref
    if ctx is None:
        raise CheckpointNotFoundError(
            f"no context is recorded for {ref!r}: run {run!r} was saved before contexts were "
            "recorded, or with capture = false (CKPT_CAPTURE=0)"
        )
    return ck, ctx


def _looks_like_id(ref: str) -> bool:
    return len(ref) == 36 and ref.count("-") == 4


def _is_run(core: StoreCore, name: str) -> bool:
    try:
        core.catalog.get_run(name)
    except CkptError:
        return False
    return True


def how_to_reproduce(ctx: RunContext) -> dict[str, Any]:
    """The "how to reproduce" section: a flat summary of a context document."""
    doc = ctx.document
    code = doc.get("code") or {}
    command = doc.get("command") or {}
    env = doc.get("environment") or {}
    return {
        "context_digest": ctx.digest,
        "from_version": ctx.from_version,
        "recorded_at": ctx.created_at.isoformat(),
        "git": bool(code.get("git")),
        "commit": code.get("commit"),
        "branch": code.get("branch"),
        "remote": code.get("remote"),
        "dirty": bool(code.get("dirty")),
        "change": code.get("patch"),
        "change_bytes": code.get("patch_bytes", 0),
        "untracked": code.get("untracked", []),
        "command": command.get("argv", []),
        "cwd": command.get("cwd"),
        "entry_blake3": command.get("entry_blake3"),
        "config": doc.get("config"),
        "data_version": doc.get("data_version"),
        "python": env.get("python"),
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "cudnn": env.get("cudnn"),
        "platform": env.get("platform"),
        "packages": env.get("packages"),
        "lock": env.get("lock"),
        "env": env.get("env", {}),
        "rng_seeds": doc.get("seeds", {}),
        "world_size": doc.get("world_size"),
        "notes": doc.get("notes", []),
    }


def lock_versions(lock: bytes) -> dict[str, str]:
    """``{name: version}`` of a lock's ``name==version`` lines."""
    out: dict[str, str] = {}
    for line in lock.decode(errors="replace").splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            out[name] = version
    return out


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    """Nested config values by dotted path."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def diff_contexts(core: StoreCore, a: Mapping[str, Any], b: Mapping[str, Any],
                  ) -> list[Difference]:
    """Every difference of config, code and environment between two context documents."""
    out: list[Difference] = []
    ca, cb = a.get("code") or {}, b.get("code") or {}
    for key in ("commit", "branch", "remote", "dirty", "patch"):
        if ca.get(key) != cb.get(key):
            out.append(Difference(f"code.{'change' if key == 'patch' else key}",
                                  ca.get(key), cb.get(key)))
    ma, mb = a.get("command") or {}, b.get("command") or {}
    for key in ("argv", "entry_blake3"):
        if ma.get(key) != mb.get(key):
            out.append(Difference(f"command.{key}", ma.get(key), mb.get(key)))
    fa, fb = _flat(a.get("config") or {}, "config"), _flat(b.get("config") or {}, "config")
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            out.append(Difference(key, fa.get(key), fb.get(key)))
    if a.get("data_version") != b.get("data_version"):
        out.append(Difference("data_version", a.get("data_version"), b.get("data_version")))
    ea, eb = a.get("environment") or {}, b.get("environment") or {}
    for key in ("python", "torch", "cuda", "cudnn", "platform"):
        if ea.get(key) != eb.get(key):
            out.append(Difference(f"environment.{key}", ea.get(key), eb.get(key)))
    if ea.get("lock") != eb.get("lock"):
        out.extend(_package_diff(core, ea.get("lock"), eb.get("lock")))
    for key in ("world_size",):
        if a.get(key) != b.get(key):
            out.append(Difference(key, a.get(key), b.get(key)))
    return out


def _lock_of(core: StoreCore, digest: str | None) -> dict[str, str]:
    if digest is None:
        return {}
    if digest == _CURRENT_LOCK:
        return lock_versions(distribution_lock())
    return lock_versions(core.catalog.context_blob(digest))


# A stand-in digest for this process's own lock (read live, not from the catalog).
_CURRENT_LOCK = "current"


def _package_diff(core: StoreCore, a: str | None, b: str | None) -> list[Difference]:
    pa, pb = _lock_of(core, a), _lock_of(core, b)
    return [Difference(f"package.{name}", pa.get(name), pb.get(name))
            for name in sorted(set(pa) | set(pb)) if pa.get(name) != pb.get(name)]


def check_against(core: StoreCore, ctx: RunContext, *, where: str | os.PathLike[str] | None =
                  None, config: Any = None) -> list[Difference]:
    """Every difference between a recorded context (a) and this checkout and process (b).

    Compares the commit, the uncommitted change, the packages (this environment's lock),
    Python, torch and the platform; the config only when ``config`` is given (the CLI
    cannot know the training script's).
    """
    recorded_env = ctx.document.get("environment") or {}
    if isinstance(recorded_env, dict) and recorded_env.get("torch") is not None:
        # The capture reads torch's versions only from a process that loaded it, and this
        # one (the CLI) has no reason to otherwise: load it to compare.
        import torch  # noqa: F401

    current = capture_context(config=config, where=where or Path.cwd()).document
    current.setdefault("environment", {})["lock"] = _CURRENT_LOCK
    recorded = dict(ctx.document)
    if config is None:
        current["config"] = recorded.get("config")
    current["data_version"] = recorded.get("data_version")
    current["command"] = recorded.get("command")  # how it is started is the recipe's job
    current["world_size"] = recorded.get("world_size")
    return diff_contexts(core, recorded, current)


# ---------------------------------------------------------------------------- recipe
def write_recipe(core: StoreCore, ref: str, directory: str | os.PathLike[str]) -> list[Path]:
    """Write the recipe that resumes checkpoint ``ref`` as it was made, into ``directory``.

    Returns:
        The files written.

    Raises:
        CheckpointNotFoundError: If ``ref`` does not resolve or has no context.
        ConfigError: If the context recorded no git commit (nothing to check out).
        IntegrityError: If a recorded blob does not match its digest.
    """
    ck = core.catalog.get(ref)
    ctx = core.catalog.context_of(ck)
    if ctx is None:
        raise CheckpointNotFoundError(
            f"no context is recorded for {ck.ref}: it was saved before contexts were "
            "recorded, or with capture = false (CKPT_CAPTURE=0)")
    doc = ctx.document
    code = doc.get("code") or {}
    if not code.get("commit"):
        raise ConfigError(
            f"the context of {ck.ref} records no git commit ({'; '.join(doc.get('notes', []))}"
            "); the recipe cannot check the code out")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def put(name: str, data: bytes, mode: int = 0o644) -> None:
        path = out / name
        replace_file(path, data, mode=mode)
        written.append(path)

    put("context.json", json.dumps({"checkpoint": ck.id, "ref": ck.ref, "run": ck.run,
                                    "step": ck.step, "context": doc}, indent=2).encode())
    if code.get("patch"):
        put("change.patch", core.catalog.context_blob(code["patch"]))
    lock_digest = (doc.get("environment") or {}).get("lock")
    if lock_digest:
        put("requirements.txt", core.catalog.context_blob(lock_digest))
    put("reproduce.sh", _script(core, ck, doc).encode(), 0o755)
    return written


def _store_exports(core: StoreCore) -> list[str]:
    """The variables that open this same store from the recipe."""
    settings = core.settings
    if settings.source is not None:
        return [f"export CKPT_CONFIG={shlex.quote(str(Path(settings.source).resolve()))}"]
    lines = [f"export CKPT_ROOT={shlex.quote(str(Path(settings.root).resolve()))}"]
    if settings.hot is not None:
        lines.append(f"export CKPT_HOT={shlex.quote(str(settings.hot))}")
    return lines


def _script(core: StoreCore, ck: Checkpoint, doc: Mapping[str, Any]) -> str:
    code, command = doc.get("code") or {}, doc.get("command") or {}
    root = Path(code.get("root") or ".")
    cwd = Path(command.get("cwd") or root)
    rel_cwd = os.path.relpath(cwd, root) if cwd.is_relative_to(root) else "."
    argv = list(command.get("argv") or [])
    entry = command.get("entry")
    if argv and entry and Path(entry).is_relative_to(root):
        # The script as the clone holds it, relative to the directory the run started in.
        argv[0] = os.path.relpath(root / Path(entry).relative_to(root), root / rel_cwd)
    source = code.get("remote") or str(root)
    q = shlex.quote
    lines = [
        "#!/bin/sh",
        f"# Resume {ck.ref} (checkpoint {ck.id}) as it was made; written by ckpt reproduce.",
        "# Usage: sh reproduce.sh [CHECKOUT]   (default ./src; an existing checkout is used)",
        "# PYTHON picks the interpreter (default: python); CKPT_REPRO_INSTALL=1 installs the",
        "# lock with pip instead of checking it; CKPT_REPRO_IGNORE_LOCK=1 goes on when the",
        "# environment differs from the lock.",
        "set -eu",
        'HERE=$(cd "$(dirname "$0")" && pwd)',
        'SRC=${1:-src}',
        'PY=${PYTHON:-python}',
        *_store_exports(core),
        "# 1. the code: the recorded commit, then the recorded uncommitted change",
        f'[ -d "$SRC/.git" ] || git clone --quiet {q(source)} "$SRC"',
        f'git -C "$SRC" checkout --quiet --detach {q(code["commit"])}',
    ]
    if code.get("patch"):
        lines.append('git -C "$SRC" apply --whitespace=nowarn "$HERE/change.patch"')
    lines += [
        "# 2. the environment: the lock, checked (or installed with CKPT_REPRO_INSTALL=1)",
        'if [ "${CKPT_REPRO_INSTALL:-0}" = 1 ]; then',
        '  "$PY" -m pip install -r "$HERE/requirements.txt"',
        "else",
        f'  "$PY" -m ckptstore reproduce {q(ck.id)} --check-lock "$HERE/requirements.txt" \\',
        '    || [ "${CKPT_REPRO_IGNORE_LOCK:-0}" = 1 ]',
        "fi",
        "# 3. the checkpoint: a verified copy on the hot tier",
        f'"$PY" -m ckptstore restore {q(ck.id)} >/dev/null',
        "# 4. the command, resuming from the checkpoint (CKPT_RESUME names it)",
        f"export {RESUME_ENV}={q(ck.id)} {RESUME_ENV}_REF={q(ck.ref)}",
        f'cd "$SRC"/{q(rel_cwd)}',
        'exec "$PY" ' + " ".join(q(a) for a in argv),
    ]
    return "\n".join(lines) + "\n"
