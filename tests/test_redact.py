"""Masking credentials: the authority's last ``@`` ends the password, for display and parsing."""

from __future__ import annotations

import pytest

from ckptstore.catalog.engine import parse_catalog_url
from ckptstore.redact import mask_url, redact_setting, register_secret, scrub, split_userinfo


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://u:p@ss@w0rd@127.0.0.1:5432/db",
         "postgresql+psycopg://u:***@127.0.0.1:5432/db"),
        ("postgresql://u:p@ss:w/rd%40x@h:1/db", "postgresql://u:***@h:1/db"),
        ("postgresql://u:p@ss?x#y@h/db", "postgresql://u:***@h/db"),
        ("postgresql://us@er:pw@[::1]:5432/db", "postgresql://us@er:***@[::1]:5432/db"),
        ("postgresql://u:pw@h/db?sslmode=require&sslpassword=k3y",
         "postgresql://u:***@h/db?sslmode=require&sslpassword=***"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("sqlite:////tmp/a@b/catalog.db", "sqlite:////tmp/a@b/catalog.db"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("http://AKID:se@cr:et@minio:9000", "http://AKID:***@minio:9000"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url_hides_everything_up_to_the_last_at(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_the_catalog_parses_by_the_same_rule() -> None:
    """What is masked is what the driver gets as the password: the rest is the host."""
    for raw, password in (("p@ss@w0rd", "p@ss@w0rd"), ("p@ss:w/rd%40x", "p@ss:w/rd@x"),
                          ("plain%3Apw", "plain:pw")):
        url = parse_catalog_url(f"postgresql://postgres:{raw}@db.example:5433/cat")
        assert (url.username, url.password, url.host, url.port, url.database) == (
            "postgres", password, "db.example", 5433, "cat")
        assert url.drivername == "postgresql+psycopg"
    # A password with nothing special is left to SQLAlchemy as it was.
    assert parse_catalog_url("postgresql://u:pw@h/db?sslmode=require").query == {
        "sslmode": "require"}


def test_split_userinfo() -> None:
    parts = split_userinfo("postgresql://u:a@b:c@host:1/db")
    assert parts is not None and (parts.user, parts.password, parts.rest) == (
        "u", "a@b:c", "host:1/db")
    assert split_userinfo("sqlite:///x.db") is None
    assert split_userinfo("postgresql://u@h/db").password is None  # type: ignore[union-attr]


def test_scrub_driver_text() -> None:
    register_secret("Zq@Xj@Kw0V")
    text = ("connection to 'postgresql://postgres:Zq@Xj@Kw0V@10.0.0.1:1/db' failed: "
            "failed to resolve host 'Xj@Kw0V@10.0.0.1'; dsn: host=h password='Zq@Xj@Kw0V' "
            "user=postgres; password=Plain-Pw99 port=5432")
    out = scrub(text)
    for piece in ("Zq@X", "Xj@K", "Kw0V", "Plain-Pw99"):
        assert piece not in out
    assert "postgres:***@10.0.0.1:1/db" in out and "port=5432" in out


def test_scrub_options_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    out = scrub("boom hunter2-secret key=abcd1234 at http://h:1",
                {"client_kwargs": {"aws_access_key_id": "abcd1234"}})
    assert out == "boom *** key=*** at http://h:1"


def test_redact_setting() -> None:
    value = {"endpoint_url": "http://a:b@c@h:9000", "secret": "s3cr3t", "n": 3,
             "list": ["postgresql://u:p@w@h/db"]}
    assert redact_setting(value) == {"endpoint_url": "http://a:***@h:9000", "secret": "***",
                                     "n": 3, "list": ["postgresql://u:***@h/db"]}
