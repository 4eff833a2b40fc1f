"""Ending the child processes a test started (through :mod:`multiprocessing` or as whole
sessions), the forkserver they came from, a test process acting as another host, and the
``torchrun`` command line that leaves nothing in /tmp.

A forkserver lives as long as any process holds its "alive" pipe, and every child it forks
gets a copy: one child left running keeps the server, and so a process of the suite, alive
after the suite has ended. Importable from any test directory (pytest puts ``tests/`` on
``sys.path``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver, util
from pathlib import Path
from typing import Any

__all__ = [
    "add_test_dir",
    "acting_as_host",
    "child_main",
    "end_children",
    "finish_child",
    "preloaded_children",
    "stop_forkserver",
    "torchrun",
    "wait_sessions",
]


def end_children(timeout: float = 10.0) -> list[int]:
    """SIGKILL every child process this process started through :mod:`multiprocessing` that
    is still running, and reap it.

    Args:
        timeout: Longest wait for each child to be reaped.

    Returns:
        The process ids of the children that were still running.
    """
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
    for child in left:
        child.join(timeout)
    return [child.pid for child in left if child.pid is not None]


def stop_forkserver(timeout: float = 10.0) -> int | None:
    """Stop this process's forkserver, if it started one: close its alive pipe (the server
    exits at end of file) and reap it, or SIGKILL it when a stray process still holds the
    pipe after ``timeout`` seconds. A later forkserver child starts a new server.

    Returns:
        The forkserver's process id, or None when none was running.
    """
    server = forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return None
        os.close(server._forkserver_alive_fd)
        address = server._forkserver_address
        server._forkserver_alive_fd = None
        server._forkserver_pid = None
        server._forkserver_address = None
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
    if address and not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    return int(pid)


@contextlib.contextmanager
def acting_as_host(host: str) -> Iterator[None]:
    """This test process as the host ``host`` (``CKPT_HOST``, which the store's process
    identity reads), restored afterwards."""
    saved = os.environ.get("CKPT_HOST")
    os.environ["CKPT_HOST"] = host
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CKPT_HOST", None)
        else:
            os.environ["CKPT_HOST"] = saved


def wait_sessions(procs: Sequence[subprocess.Popen[str]] | Sequence[subprocess.Popen[bytes]],
                  timeout: float) -> None:
    """Wait for processes started with ``start_new_session=True``, each at most ``timeout``
    seconds; whatever is still running then is killed with its whole session (SIGKILL to its
    process group), so nothing a test started outlives it."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def add_test_dir(directory: Path) -> None:
    """Append a test directory to ``sys.path``: this process and the forkserver's children
    (which get its ``sys.path``) then import the helper scripts there. Appended, not
    prepended: the directory's ``conftest.py`` must not shadow another module named
    conftest."""
    if str(directory) not in sys.path:
        sys.path.append(str(directory))


def preloaded_children(preload: Sequence[str],
                       path: Path | None = None) -> Iterator[multiprocessing.context.BaseContext]:
    """Yield a :mod:`multiprocessing` context whose children start from a forkserver that
    imported ``preload`` once (each child still its own process: killed for real, its exit
    code its own); the server and any child left are stopped afterwards. For a fixture:
    ``yield from preloaded_children([...])``.

    A module of ``preload`` the server cannot import is skipped without a word (the
    children then import it themselves, paying for it each time): check what a new preload
    saves. ``path``, a test directory the children import from, is appended to ``sys.path``
    before the server starts, so the children get it (appended: its ``conftest.py`` must
    not shadow another one).

    When another module's forkserver runs already (this one's path and preloads unknown to
    it), the context spawns fresh interpreters instead: slower, always right.
    """
    if path is not None:
        add_test_dir(path)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    if getattr(server, "_forkserver_pid", None) is not None:
        yield multiprocessing.get_context("spawn")
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    try:
        yield ctx
    finally:
        end_children()
        stop_forkserver()


def finish_child(child: Any, timeout: float = 300) -> int:
    """Wait for a :mod:`multiprocessing` child (SIGKILL it past ``timeout``); its exit code
    (negative: the signal that ended it)."""
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
    return int(child.exitcode)


def child_main(main: Callable[[], object], script: str, args: Sequence[str],
               env: dict[str, str], drop: Sequence[str], output: str) -> None:
    """Run a script's ``main`` in a :mod:`multiprocessing` child as ``python script ARGS``
    would: the variables ``drop`` removed from the environment and ``env`` added, standard
    output and error appended to the file ``output``, ``sys.argv`` set."""
    for var in drop:
        os.environ.pop(var, None)
    os.environ.update(env)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *args]
    main()


def torchrun(log_dir: Path) -> list[str]:
    """The start of a ``torchrun`` command line: this environment's launcher, with its own
    files (``--log-dir``) in ``log_dir``, inside the test's directory. Without it each launch
    leaves a ``torchelastic_*`` directory in /tmp."""
    return [str(Path(sys.executable).with_name("torchrun")), "--log-dir", str(log_dir)]
