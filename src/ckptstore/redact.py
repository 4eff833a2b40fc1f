"""Keeping credentials out of everything ckptstore shows: settings, errors and logs.

The one owner of "what is a secret and how is it hidden". Every place that prints a URL
(``ckpt config``, error messages, log lines, the web view, the store marker) masks it with
:func:`mask_url`; every place that passes on text it did not write (a database driver's or
an S3 client's error message) cleans it with :func:`scrub` first.

Where a URL's password ends: RFC 3986 wants ``@``, ``:`` and ``/`` inside a password
percent-encoded, but people paste them raw (``postgresql://u:p@ss@db:5432/x``). A host never
holds ``@``, so the password ends at the *last* ``@`` of the authority: the last ``@``
after which a plain ``host[:port]``, a path without ``@`` and a query follow
(:func:`split_userinfo`). A query value holding ``@`` must then be percent-encoded
(``%40``), as RFC 3986 asks anyway. The catalog parses its URL by the same rule
(:func:`ckptstore.catalog.engine.parse_catalog_url`), so what is masked is exactly what the
driver receives as the password.

A driver can also repeat a password in a form no pattern finds (a host name built from its
tail, a DSN fragment). Passwords the process has parsed are therefore remembered
(:func:`register_secret`) and replaced wherever they appear, like the values of the AWS
credential variables and of secret ``storage_options``.

Pure text functions with no imports of ours: every layer may use them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

__all__ = [
    "MASK",
    "RedactingFormatter",
    "UserInfo",
    "is_secret_option",
    "mask_url",
    "redact_setting",
    "register_secret",
    "scrub",
    "split_userinfo",
]

#: What a secret is replaced with.
MASK = "***"

# Keys of storage_options (and query parameters) whose values are secrets.
_SECRET_OPTION_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "session_token",
        "access_key",
        "secret_key",
    }
)
_SECRET_ENV_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
)
# Shorter values are not replaced inside free text: a 3-letter secret would mangle every
# word that contains it. URL passwords and ``password=`` fields are masked whatever their
# length.
_MIN_SECRET_CHARS = 4
# Distinct passwords remembered per process (a process opens a handful of catalogs).
_MAX_REGISTERED = 256

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# What may follow the ``@`` that ends the userinfo: host[:port] (or [ipv6]:port), a path
# without ``@``, then a query or fragment.
_AFTER_USERINFO = re.compile(
    r"(?:\[[^\]@/?#\s]*\]|[^@/?#\[\]\s]*)(?::[^@/?#\s]*)?(?:/[^@?#\s]*)?(?:[?#]\S*)?"
)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")
# ``password=...`` in a query string, a libpq DSN (``password='it''s'``) or a message.
_SECRET_FIELD = re.compile(
    r"(?i)(?<![A-Za-z0-9_])(password|passwd|pwd|sslpassword|secret|token|"
    r"aws_secret_access_key|secret_access_key|aws_session_token|session_token)"
    r"(\s*=\s*)('(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.)*\"|[^\s&'\",;)]+)"
)

_registered: dict[str, None] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class UserInfo:
    """A URL cut around its userinfo.

    Attributes:
        head: The scheme and ``://``.
        user: The user name as written (percent-encoded or not).
        password: The password as written, or None when the userinfo has no ``:``.
        rest: Everything after the ``@``: host, port, path, query.
    """

    head: str
    user: str
    password: str | None
    rest: str


def split_userinfo(url: str) -> UserInfo | None:
    """Cut ``url`` around its userinfo, the password ending at the authority's last ``@``.

    Args:
        url: A URL such as ``postgresql+psycopg://user:p@ss@host:5432/db``.

    Returns:
        The parts, or None when the URL has no userinfo (or is not a URL).

    Example:
        >>> split_userinfo("postgresql://u:p@ss@db:5432/x").password
        'p@ss'
    """
    scheme = _SCHEME.match(url)
    if scheme is None:
        return None
    body = url[scheme.end():]
    at = body.rfind("@")
    while at != -1:
        if _AFTER_USERINFO.fullmatch(body, at + 1):
            user, colon, password = body[:at].partition(":")
            if "/" in user or "?" in user or "#" in user:
                return None  # an '@' in a path (sqlite:///dir@x/db), not a userinfo
            return UserInfo(url[:scheme.end()], user, password if colon else None,
                            body[at + 1:])
        at = body.rfind("@", 0, at)
    return None


def mask_url(url: object) -> str:
    """Render a URL with its password and secret query parameters replaced by ``***``.

    Works on any text (a string SQLAlchemy cannot parse, a SQLAlchemy ``URL``, a path), so
    it is safe in the message about a bad URL.

    Args:
        url: A URL string or object (``str(url)`` is masked).

    Returns:
        The URL without its credentials.

    Example:
        >>> mask_url("postgresql+psycopg://ckpt:p@ss:w/rd@db:5432/catalog")
        'postgresql+psycopg://ckpt:***@db:5432/catalog'
    """
    text = str(url)
    parts = split_userinfo(text)
    if parts is not None:
        if parts.password is not None:
            text = f"{parts.head}{parts.user}:{MASK}@{parts.rest}"
    elif _SCHEME.match(text):
        text = _mask_to_last_at(text)
    return _SECRET_FIELD.sub(_mask_field, text)


def _mask_to_last_at(token: str) -> str:
    """For a URL no rule above could cut: hide everything between ``user:`` and the last
    ``@`` (more than the password, never less)."""
    scheme = _SCHEME.match(token)
    at = token.rfind("@")
    if scheme is None or at < scheme.end():
        return token
    user, colon, _ = token[scheme.end():at].partition(":")
    if not colon or "/" in user:
        return token
    return f"{token[:scheme.end()]}{user}:{MASK}{token[at:]}"


def _mask_field(match: re.Match[str]) -> str:
    return f"{match.group(1)}{match.group(2)}{MASK}"


def register_secret(value: str | None) -> None:
    """Remember a password so that :func:`scrub` replaces it wherever it appears.

    Its raw, percent-decoded and percent-encoded spellings are all remembered, and so is
    each tail after an ``@`` in it: a parser that ends the userinfo at the first ``@`` takes
    that tail for the host and puts it into its messages. Called by the catalog for the
    password of every URL it parses.
    """
    if not value:
        return
    decoded = unquote(value)
    forms = {value, decoded, quote(decoded, safe="")}
    forms.update(form[i + 1:] for form in (value, decoded) for i, ch in enumerate(form)
                 if ch == "@")
    with _lock:
        for form in forms:
            if len(form) >= _MIN_SECRET_CHARS:
                _registered.pop(form, None)
                _registered[form] = None
        while len(_registered) > _MAX_REGISTERED:
            _registered.pop(next(iter(_registered)))


def is_secret_option(name: str) -> bool:
    """Whether a ``storage_options`` key holds a secret (its value must never be shown)."""
    return name.lower() in _SECRET_OPTION_KEYS


def _option_secrets(options: Mapping[str, Any], out: set[str]) -> None:
    for name, value in options.items():
        if isinstance(value, Mapping):
            _option_secrets(value, out)
        elif isinstance(value, str) and is_secret_option(str(name)):
            out.add(value)


def scrub(text: str, options: Mapping[str, Any] | None = None,
          secrets: Iterable[str] = ()) -> str:
    """Remove every credential ``text`` may hold: pass driver and backend messages through it.

    Masks the password of every URL in the text (:func:`mask_url`), ``password=...`` and
    similar fields (query strings, libpq DSNs), and replaces the known secret values: the
    passwords registered with :func:`register_secret`, the AWS credential variables, the
    secret entries of ``options`` (at any depth) and ``secrets``.

    Args:
        text: The message.
        options: ``storage_options`` whose secret values must not appear.
        secrets: More values that must not appear.

    Returns:
        The message without them.
    """
    known = set(secrets)
    if options:
        _option_secrets(options, known)
    for var in _SECRET_ENV_VARS:
        value = os.environ.get(var)
        if value:
            known.add(value)
    with _lock:
        known.update(_registered)
    # Known values first: a URL pattern could otherwise cut one in two and leave its tail.
    for secret in sorted(known, key=len, reverse=True):
        if len(secret) >= _MIN_SECRET_CHARS:
            text = text.replace(secret, MASK)
    text = _URL_IN_TEXT.sub(lambda m: mask_url(m.group(0)), text)
    return _SECRET_FIELD.sub(_mask_field, text)


def redact_setting(value: Any, key: str = "") -> Any:
    """A setting's value as it may be shown: URL passwords and secret options masked.

    Args:
        value: Plain data (str, number, list, dict, None).
        key: The setting's or option's name; a secret option's value is masked whole.

    Returns:
        The same structure without credentials.
    """
    if key and is_secret_option(key) and value not in (None, ""):
        return MASK
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {k: redact_setting(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_setting(v) for v in value]
    return value


class RedactingFormatter(logging.Formatter):
    """A log formatter whose lines (message and traceback) went through :func:`scrub`."""

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record`` as :class:`logging.Formatter` does, then scrub it."""
        return scrub(super().format(record))
