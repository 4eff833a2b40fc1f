"""No credential ever reaches ``ckpt``'s output, its logs or the store's files.

Passwords hold what RFC 3986 wants percent-encoded but people paste raw (``@``, ``:``,
``/``) and a percent-escape (``%40``). Before the masking rule "the password ends at the
authority's last ``@``", ``ckpt config`` showed ``p:***@ss@w0rd@host`` and the driver's own
error text repeated the rest (``failed to resolve host 'ss@w0rd@127.0.0.1'``).

The command lines run through the real ``ckpt`` entry point in one child process per logging
mode (tests/cli/masking_driver.py), with ``--verbose`` so log lines are written too: plain
text on stderr, and JSON lines with ``CKPT_LOG_JSON=1``. The child comes from a forkserver
that preloaded torch, SQLAlchemy and the other heavy third-party packages (not ckptstore: the
CLI is imported and configures its logging in the child), so that it does not pay seconds of
imports as a fresh interpreter would.
"""

from __future__ import annotations

import json
import multiprocessing
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pg_support import PG_HOST, PG_PORT, create_pg_database, drop_pg_database, require_pg
from process_support import add_test_dir, finish_child, preloaded_children
from sqlalchemy.engine import make_url

from ckptstore.testing.ports import free_port

HERE = Path(__file__).parent
add_test_dir(HERE)  # before importing its helper scripts; the children get it too

import masking_driver  # noqa: E402

#: Third-party packages only: the CLI's own modules set up consoles and read the environment
#: when imported (and typer's read it too), so the child imports them itself.
_PRELOAD = ["torch", "numpy", "numcodecs", "sqlalchemy", "psycopg", "alembic",
            "alembic.command", "alembic.config", "pydantic", "prometheus_client", "mako"]
# Distinctive letters, so that any 4-character piece of a password found in the output is a
# leak and not a coincidence.
PASSWORDS = ["Zq@Xj@Kw0V", "Zq@Xj:Kv/Wm%40Yp"]
S3_PASSWORD = "Qh@Vz:Jk/Wr"


def _pieces(password: str) -> set[str]:
    """Every 4-character piece of the password as written and as decoded."""
    from urllib.parse import quote, unquote

    forms = {password, unquote(password), quote(unquote(password), safe="")}
    return {form[i:i + 4] for form in forms for i in range(len(form) - 3)}


@pytest.fixture(scope="module")
def drivers() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the drivers start: a forkserver with the heavy packages imported, stopped with
    the module. When another module's forkserver runs already, spawned children instead:
    slower, always right."""
    yield from preloaded_children(_PRELOAD)


def _drive(ctx: multiprocessing.context.BaseContext, lines: list[dict[str, object]],
           env: dict[str, str], cwd: Path) -> tuple[dict[int, int], str, str]:
    """Run the command lines; return each one's exit code, and all stdout and stderr."""
    drop = [var for var in ("CKPT_CONFIG", "CKPT_ROOT", "CKPT_CATALOG_URL", "CKPT_LOG_JSON")
            if var not in env]
    out, err = cwd / "driver.out", cwd / "driver.err"
    child = ctx.Process(  # type: ignore[attr-defined]
        target=masking_driver.run_in_child,
        args=([json.dumps(x) for x in lines], {"COLUMNS": "250", **env}, drop, str(cwd),
              str(out), str(err)))
    child.start()
    code = finish_child(child, 300)
    stdout, stderr = out.read_text(), err.read_text()
    out.unlink()
    err.unlink()
    assert code == 0, stderr[-3000:]
    codes = {int(m.group(1)): int(m.group(2))
             for m in re.finditer(r"^=== (\d+) exit (-?\d+)$", stdout, re.M)}
    assert len(codes) == len(lines), stdout[-3000:] + stderr[-3000:]
    return codes, stdout, stderr


def _section(text: str, n: int) -> str:
    """What command line ``n`` printed on a stream."""
    start = text.index(f"=== {n}\n")
    end = text.find(f"=== {n + 1}\n", start)
    return text[start:end if end != -1 else len(text)]


def _files_text(root: Path) -> str:
    """Every file under ``root`` as text (catalog, marker, logs)."""
    parts = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            parts.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts)


def _assert_clean(password: str, *texts: str) -> None:
    for piece in sorted(_pieces(password)):
        for text in texts:
            assert piece not in text, f"{piece!r} of the password leaked:\n{text[-4000:]}"


@pytest.fixture
def pg_dbs() -> Iterator[list[str]]:
    """Fresh, empty databases on the development PostgreSQL, one per password (trust auth:
    any password connects)."""
    require_pg()
    urls: list[str] = []
    try:
        for _ in PASSWORDS:
            urls.append(create_pg_database("ckpt_mask"))
        yield [make_url(url).database or "" for url in urls]
    finally:
        for url in urls:
            drop_pg_database(url)


@pytest.mark.parametrize("log_json", [False, True], ids=["text-logs", "json-logs"])
def test_catalog_password_never_shown(tmp_path: Path, pg_dbs: list[str], log_json: bool,
                                      drivers: multiprocessing.context.BaseContext) -> None:
    closed = free_port()  # nothing listens there
    lines: list[dict[str, object]] = []
    expect: list[tuple[str, int]] = []  # (what, exit code)
    for i, (password, pg_db) in enumerate(zip(PASSWORDS, pg_dbs, strict=True)):
        root = tmp_path / f"store{i}"
        urls = {
            "unreachable": f"postgresql+psycopg://postgres:{password}@127.0.0.1:{closed}/db",
            "wrong-db": (f"postgresql+psycopg://postgres:{password}@{PG_HOST}:{PG_PORT}/"
                         f"{pg_db}_missing"),
            "good": f"postgresql+psycopg://postgres:{password}@{PG_HOST}:{PG_PORT}/{pg_db}",
        }
        for what, url in urls.items():
            env = {"CKPT_CATALOG_URL": url}
            store = ["--store", str(root / what), "--verbose"]
            if what == "good":  # a store there; the others cannot be reached to make one
                lines.append({"args": ["init", *store], "env": env})
                expect.append(("good init", 0))
            for json_opt in ([], ["--json"]):
                lines.append({"args": ["config", *json_opt, *store], "env": env})
                expect.append((f"{what} config {json_opt}", 0))
                lines.append({"args": ["ls", *json_opt, *store], "env": env})
                expect.append((f"{what} ls {json_opt}", 0 if what == "good" else 1))
        good = {"CKPT_CATALOG_URL": urls["good"]}
        store = ["--store", str(root / "good"), "--verbose"]
        for args in (["db", "current", "--json"], ["doctor", "--json"], ["tiers"],
                     ["tiers", "--json"], ["db", "upgrade"]):
            lines.append({"args": [*args, *store], "env": good})
            expect.append((f"good {args}", 0))
    env = {"CKPT_LOG_JSON": "1"} if log_json else {}
    codes, out, err = _drive(drivers, lines, env, tmp_path)
    for n, (what, code) in enumerate(expect):
        assert codes[n] == code, (what, _section(out, n), _section(err, n))
    for i, password in enumerate(PASSWORDS):
        _assert_clean(password, out, err, _files_text(tmp_path / f"store{i}"))
    # The masked URL still says where the catalog is, and the errors say what failed.
    assert f"postgres:***@127.0.0.1:{closed}/db" in out
    assert "Connection refused" in out + err or "connection failed" in out + err
    assert f'database "{pg_dbs[0]}_missing" does not exist' in out + err
    if log_json:
        # ``--verbose`` after the command name turns the JSON lines to INFO too: the catalog
        # URL is logged, masked.
        records = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
        assert any("postgres:***@" in r["msg"] for r in records), err[-3000:]


def test_endpoint_credentials_are_refused_and_masked(
        tmp_path: Path, drivers: multiprocessing.context.BaseContext) -> None:
    """S3 credentials are never configured in a URL: an ``endpoint_url`` or a tier URL with
    userinfo is refused with a message that masks it, and ``ckpt config`` masks it."""
    endpoint = f"http://AKIDEXAMPLE:{S3_PASSWORD}@127.0.0.1:{free_port()}"
    lines: list[dict[str, object]] = []
    with_endpoint = {"CKPT_STORAGE_OPTIONS": json.dumps({"endpoint_url": endpoint}),
                     "CKPT_WARM": "s3://bucket/warm"}
    in_tier = {"CKPT_WARM": f"s3://AKIDEXAMPLE:{S3_PASSWORD}@bucket/warm"}
    lines.append({"args": ["init", "--store", str(tmp_path / "s")], "env": {}})
    for env in (with_endpoint, in_tier):
        for args in (["config"], ["config", "--json"], ["tiers"], ["tiers", "--json"]):
            lines.append({"args": [*args, "--store", str(tmp_path / "s"), "--verbose"],
                          "env": env})
    codes, out, err = _drive(drivers, lines, {"CKPT_LOG_JSON": "1"}, tmp_path)
    assert [codes[n] for n in range(len(lines))] == [0, *[0, 0, 1, 1] * 2]
    _assert_clean(S3_PASSWORD, out, err, _files_text(tmp_path))
    assert "AKIDEXAMPLE:***@127.0.0.1" in out
    assert "carries credentials" in out + err
