"""What made a checkpoint: the run's code, command, environment and configuration.

:func:`capture_context` reads, without being asked, what a person needs to reproduce a run:

* **code**: the git commit, branch and remote (credentials masked by
  :func:`ckptstore.redact.mask_url`), whether the checkout is dirty, and the uncommitted
  change itself as one patch (``git diff HEAD --binary`` plus every untracked file under
  :data:`MAX_UNTRACKED_FILE_BYTES`, as ``git apply`` reads it);
* **command**: ``sys.argv``, the working directory and the entry script's blake3;
* **environment**: Python, the platform, torch with CUDA and cuDNN when torch is loaded, a
  lock of the installed distributions (``name==version``), and the environment variables
  the user allowed (nothing else of the environment is read);
* **config**: the training configuration as JSON-safe values, secrets masked
  (:func:`safe_config`), and the data version;
* **seeds and world size**.

The patch and the lock are returned as blobs keyed by their blake3 digest (``b3:<hex>``); the
document names them by digest, so a lock shared by a thousand runs is stored once. Nothing
here raises on a bad input: a config that is not JSON, a detached or broken repository, a
huge untracked file, no git binary at all each become a note in the document's ``notes``;
a save must never fail because its context could not be read.

Pure reading of the process and the working tree; no catalog, no store. The write side is
:mod:`ckptstore.ops.writing.context`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from ckptstore.redact import MASK, mask_url

__all__ = [
    "CONTEXT_SCHEMA",
    "MAX_PATCH_BYTES",
    "MAX_UNTRACKED_FILES",
    "MAX_UNTRACKED_FILE_BYTES",
    "Captured",
    "blob_digest",
    "capture_context",
    "config_hash",
    "context_digest",
    "distribution_lock",
    "is_secret_key",
    "safe_config",
]

#: Version of the context document's layout.
CONTEXT_SCHEMA = 1
#: Untracked files larger than this are left out of the recorded change (and named in a note).
MAX_UNTRACKED_FILE_BYTES = 1024 * 1024
#: At most this many untracked files are recorded (one ``git diff --no-index`` each); the
#: rest are named in a note.
MAX_UNTRACKED_FILES = 200
#: The recorded change as a whole is left out above this size (a note says so).
MAX_PATCH_BYTES = 16 * 1024 * 1024
# git answers in milliseconds; a hung one (a network filesystem, a lock) must not stall a save.
_GIT_TIMEOUT_S = 10.0
# Keys whose values never leave the process: tokens, secrets, passwords, keys.
_SECRET_KEY = re.compile(r"token|secret|passw(or)?d|(^|[_\-.])key($|[_\-.])|api_?key|"
                         r"credential|private", re.IGNORECASE)
# Nesting of config values beyond this is cut (a note says so): configs are tables, not graphs.
_MAX_DEPTH = 32


@dataclass(frozen=True)
class Captured:
    """A captured context: the JSON document and the blobs it names by digest."""

    document: dict[str, Any]
    blobs: dict[str, bytes] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """The document's digest (:func:`context_digest`)."""
        return context_digest(self.document)


def blob_digest(data: bytes) -> str:
    """``b3:<hex>``: the content address of a blob."""
    return "b3:" + blake3.blake3(data).hexdigest()


def context_digest(document: Mapping[str, Any]) -> str:
    """The digest of a context document: equal documents, equal digests."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return blob_digest(text.encode())


def is_secret_key(key: str) -> bool:
    """Whether a config key names a secret (token, secret, password, key, ...)."""
    return bool(_SECRET_KEY.search(key))


def safe_config(config: Any, notes: list[str] | None = None) -> Any:
    """``config`` as JSON-safe values with every secret masked.

    Mappings keep their (string) keys; tuples, lists and sets become lists; numbers that
    JSON cannot hold (NaN, infinities) and other objects become their ``repr`` text, each
    with a note, so a config that is not JSON-serialisable is still recorded, readably.
    Objects with ``to_dict()`` (HF ``TrainingArguments``) or ``_asdict``/``__dict__`` of
    plain values (namespaces) are read through those.
    """
    notes = notes if notes is not None else []
    return _safe(config, notes, "config", 0)


def _safe(value: Any, notes: list[str], path: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        notes.append(f"{path}: nested deeper than {_MAX_DEPTH} levels, cut")
        return None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        notes.append(f"{path}: {value!r} is not a JSON number, recorded as text")
        return repr(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            name = key if isinstance(key, str) else str(key)
            out[name] = (MASK if is_secret_key(name) and item not in (None, "")
                         else _safe(item, notes, f"{path}.{name}", depth + 1))
        return out
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [_safe(v, notes, f"{path}[{i}]", depth + 1) for i, v in enumerate(items)]
    if isinstance(value, Path):
        return str(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return _safe(to_dict(), notes, path, depth + 1)
        except Exception as exc:  # a user's to_dict: whatever it raises becomes a note
            notes.append(f"{path}: to_dict() failed ({type(exc).__name__}: {exc})")
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        try:
            return _safe(item(), notes, path, depth + 1)
        except Exception:
            pass
    if hasattr(value, "__dict__") and type(value).__module__ in ("argparse", "types"):
        return _safe(vars(value), notes, path, depth + 1)
    notes.append(f"{path}: {type(value).__name__} is not JSON-serialisable, recorded as text")
    return repr(value)[:1000]


# ---------------------------------------------------------------------------- code
def _git(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, timeout=_GIT_TIMEOUT_S, check=False,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"},
    )


def _git_text(args: Sequence[str], cwd: Path) -> str | None:
    done = _git(args, cwd)
    return done.stdout.decode(errors="replace").strip() if done.returncode == 0 else None


def _code(where: Path, notes: list[str], blobs: dict[str, bytes]) -> dict[str, Any]:
    """The git state of the checkout holding ``where``."""
    if shutil.which("git") is None:
        notes.append("code: no git binary on PATH; the code version is not recorded")
        return {"git": False}
    try:
        root_text = _git_text(["rev-parse", "--show-toplevel"], where)
        if root_text is None:
            notes.append(f"code: {where} is not inside a git repository; "
                         "the code version is not recorded")
            return {"git": False}
        root = Path(root_text)
        out: dict[str, Any] = {"git": True, "root": str(root)}
        commit = _git_text(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"], root)
        if commit is None:
            notes.append("code: the repository has no commit yet (or HEAD is broken)")
            out["commit"] = None
        else:
            out["commit"] = commit
        branch = _git_text(["symbolic-ref", "--quiet", "--short", "HEAD"], root)
        out["branch"] = branch
        if branch is None and commit is not None:
            notes.append("code: HEAD is detached (no branch); the commit is recorded")
        remote = None
        upstream = _git_text(["config", "--get", f"branch.{branch}.remote"], root) if branch \
            else None
        for name in (upstream, "origin"):
            if name and (url := _git_text(["remote", "get-url", name], root)):
                remote = mask_url(url)
                break
        out["remote"] = remote
        out.update(_change(root, commit, notes, blobs))
        return out
    except (OSError, subprocess.SubprocessError) as exc:
        notes.append(f"code: git failed ({type(exc).__name__}: {exc})")
        return {"git": False}


def _change(root: Path, commit: str | None, notes: list[str],
            blobs: dict[str, bytes]) -> dict[str, Any]:
    """The uncommitted change: tracked edits and untracked files, as one patch."""
    parts: list[bytes] = []
    if commit is not None:
        diff = _git(["diff", "HEAD", "--binary", "--no-color", "--no-ext-diff"], root)
        if diff.returncode != 0:
            notes.append("code: git diff failed: "
                         + diff.stderr.decode(errors="replace").strip()[:300])
        else:
            parts.append(diff.stdout)
    listed = _git(["ls-files", "--others", "--exclude-standard", "-z"], root)
    untracked = [n for n in listed.stdout.decode(errors="replace").split("\0") if n] \
        if listed.returncode == 0 else []
    kept, skipped = [], []
    if len(untracked) > MAX_UNTRACKED_FILES:
        notes.append(f"code: {len(untracked)} untracked files, only the first "
                     f"{MAX_UNTRACKED_FILES} are recorded; add the others to .gitignore "
                     "or commit them")
        untracked = sorted(untracked)[:MAX_UNTRACKED_FILES]
    for name in sorted(untracked):
        path = root / name
        try:
            size = path.lstat().st_size
        except OSError:
            continue
        if size > MAX_UNTRACKED_FILE_BYTES:
            skipped.append(name)
            continue
        new = _git(["diff", "--binary", "--no-color", "--no-index", "--", "/dev/null", name],
                   root)
        if new.returncode in (0, 1):  # 1: the files differ, which they do
            parts.append(new.stdout)
            kept.append(name)
    if skipped:
        notes.append(f"code: {len(skipped)} untracked file(s) over "
                     f"{MAX_UNTRACKED_FILE_BYTES} bytes left out of the change: "
                     + ", ".join(skipped[:10]))
    patch = b"".join(parts)
    out: dict[str, Any] = {"dirty": bool(patch) or bool(skipped), "untracked": kept,
                           "untracked_skipped": skipped, "patch": None,
                           "patch_bytes": len(patch)}
    if len(patch) > MAX_PATCH_BYTES:
        notes.append(f"code: the uncommitted change is {len(patch)} bytes, over "
                     f"{MAX_PATCH_BYTES}; it is not recorded")
    elif patch:
        digest = blob_digest(patch)
        blobs[digest] = patch
        out["patch"] = digest
    return out


# ---------------------------------------------------------------------------- command
def _command(notes: list[str]) -> dict[str, Any]:
    argv = [str(a) for a in sys.argv]
    out: dict[str, Any] = {"argv": argv, "cwd": os.getcwd(), "executable": sys.executable,
                           "entry": None, "entry_blake3": None}
    main = sys.modules.get("__main__")
    entry = getattr(main, "__file__", None) or (argv[0] if argv and argv[0] else None)
    if entry and entry not in ("-c", "-m"):
        path = Path(entry).resolve()
        out["entry"] = str(path)
        try:
            out["entry_blake3"] = blob_digest(path.read_bytes()) if path.is_file() else None
        except OSError as exc:
            notes.append(f"command: cannot read the entry script {path} ({exc})")
    return out


# ---------------------------------------------------------------------------- environment
def distribution_lock() -> bytes:
    """The installed distributions as sorted ``name==version`` lines (a requirements file).

    Read once per process and import path (a quarter of a second over a few hundred
    distributions): what is installed does not change under a running training process.
    """
    key = tuple(sys.path)
    cached = _LOCKS.get(key)
    if cached is None:
        cached = _LOCKS[key] = _read_lock()
    return cached


_LOCKS: dict[tuple[str, ...], bytes] = {}


def _read_lock() -> bytes:
    from importlib import metadata

    seen: dict[str, str] = {}
    for dist in metadata.distributions():
        # A distribution with a damaged METADATA file has no name; it is left out.
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if name and dist.version:
            seen.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return "".join(f"{n}=={v}\n" for n, v in sorted(seen.items())).encode()


def _environment(env_allow: Iterable[str], notes: list[str],
                 blobs: dict[str, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": None, "cuda": None, "cudnn": None, "gpus": [],
    }
    torch = sys.modules.get("torch")  # read only when the training process loaded it
    if torch is not None:
        try:
            out["torch"] = str(torch.__version__)
            out["cuda"] = torch.version.cuda
            if torch.backends.cudnn.is_available():
                out["cudnn"] = torch.backends.cudnn.version()
            if torch.cuda.is_available():
                out["gpus"] = [torch.cuda.get_device_name(i)
                               for i in range(torch.cuda.device_count())]
        except Exception as exc:  # a broken CUDA install must not fail the save
            notes.append(f"environment: torch details unavailable ({type(exc).__name__})")
    try:
        lock = distribution_lock()
        digest = blob_digest(lock)
        blobs[digest] = lock
        out["lock"] = digest
        out["packages"] = lock.count(b"\n")
    except Exception as exc:  # importlib.metadata over a broken site-packages
        notes.append(f"environment: cannot list installed distributions ({exc})")
        out["lock"] = None
    allowed = sorted({str(n) for n in env_allow})
    out["env"] = {n: (MASK if is_secret_key(n) else os.environ[n])
                  for n in allowed if n in os.environ}
    return out


def _seeds() -> dict[str, Any]:
    out: dict[str, Any] = {"pythonhashseed": os.environ.get("PYTHONHASHSEED")}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            out["torch"] = int(torch.initial_seed())
        except Exception:
            pass
    return out


def _world() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    try:
        dist = getattr(torch, "distributed", None) if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            return {"world_size": dist.get_world_size(), "rank": dist.get_rank()}
    except Exception:
        pass
    size, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return {"world_size": int(size) if size.isdigit() else 1,
            "rank": int(rank) if rank.isdigit() else 0}


def _code_dir(entry: str | None) -> Path:
    """Where the code runs from: the entry script's directory, else the working directory.

    A console script of an installed package (``pytest``, ``torchrun``, ``accelerate``:
    under ``sys.prefix``) says nothing of the user's code; the working directory does.
    """
    if entry:
        path = Path(entry)
        if path.is_file() and not path.is_relative_to(Path(sys.prefix).resolve()):
            return path.parent
    return Path.cwd()


def capture_context(
    *,
    config: Any = None,
    data_version: str | None = None,
    env_allow: Iterable[str] = (),
    where: str | os.PathLike[str] | None = None,
) -> Captured:
    """Read the context of this process; never raises.

    Args:
        config: The training configuration (any nesting; see :func:`safe_config`).
        data_version: The data set's version, as the user names it.
        env_allow: Names of environment variables to record (none by default).
        where: Directory whose git checkout is recorded (default: the entry script's,
            else the working directory: :func:`_code_dir`).

    Returns:
        The document and the blobs it names (the patch, the lock).
    """
    notes: list[str] = []
    blobs: dict[str, bytes] = {}
    document: dict[str, Any] = {"schema": CONTEXT_SCHEMA}
    try:
        command = _command(notes)
        if where is None:
            where = _code_dir(command.get("entry"))
        document["code"] = _code(Path(where), notes, blobs)
        document["command"] = command
        document["environment"] = _environment(env_allow, notes, blobs)
        document["config"] = safe_config(config, notes) if config is not None else None
        document["data_version"] = None if data_version is None else str(data_version)
        document["seeds"] = _seeds()
        document.update(_world())
    except Exception as exc:  # the last guard: a save never fails on its context
        notes.append(f"context: capture failed ({type(exc).__name__}: {exc})")
    document["notes"] = notes
    # One check that the document is JSON as stored: a value that slipped through as a
    # non-JSON type is caught here rather than by the catalog's insert.
    try:
        json.dumps(document, allow_nan=False)
    except (TypeError, ValueError) as exc:
        document = {"schema": CONTEXT_SCHEMA, "notes": [*notes, f"context: not JSON ({exc})"]}
    return Captured(document=document, blobs=blobs)


def config_hash(config: Any) -> str:
    """A cheap fingerprint of a config as given, to notice a change between saves."""
    notes: list[str] = []
    text = json.dumps(safe_config(config, notes), sort_keys=True, default=str)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
