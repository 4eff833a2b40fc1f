"""Encryption key files: X25519 keys for sealed (encrypted) copies, read and checked.

Below the configuration on purpose: ``[tiers] encrypt_to`` is checked when the settings are
loaded (:mod:`ckptstore.config`), so a wrong recipient (a missing file, an Ed25519 signing
key, a private key) is a :class:`~ckptstore.errors.ConfigError` before anything is written,
not a failure in the middle of an archive flow. Everything above (the sealed format in
:mod:`ckptstore.format.crypt`, pushes and bundles) loads keys through here.

Keys are PEM files (``ckpt keygen --encryption --out DIR``: a PKCS#8 private key with mode
0600 and a SubjectPublicKeyInfo public key). A signing key given where an encryption key is
expected, or the reverse, is refused with the command that makes the right kind. No key material
reaches the catalog, logs or errors; a public key's sha256 fingerprint names it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import ConfigError
from ckptstore.extras import require

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = [
    "KEYGEN_HINT",
    "encryption_fingerprint",
    "load_decryption_key",
    "load_encryption_key",
    "raw_public",
]

logger = logging.getLogger(__name__)

_MAX_KEY_FILE = 64 * 1024
#: What to do about a missing or wrong key: make an encryption pair.
KEYGEN_HINT = "generate an encryption key pair with `ckpt keygen --encryption --out DIR`"
_KEYGEN_HINT = KEYGEN_HINT


def _need_cryptography() -> None:
    require("cryptography.hazmat.primitives.ciphers.aead",
            "encrypted copies (--encrypt-to, --key, keygen --encryption)")


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        if path.stat().st_size > _MAX_KEY_FILE:
            raise ConfigError(f"{path} is too large to be a {what} key file")
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} key {path}: {exc.strerror}; "
                          f"{_KEYGEN_HINT}") from exc


def _kind_error(path: Path, key: Any, expected: str) -> ConfigError:
    """The error for a key of the wrong kind: a signing key where an encryption key is due."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    if isinstance(key, Ed25519PrivateKey | Ed25519PublicKey):
        return ConfigError(f"{path} holds an Ed25519 signing key, not an X25519 {expected} "
                           f"key: signing keys sign, they cannot encrypt; {_KEYGEN_HINT}")
    return ConfigError(f"{path} holds a {type(key).__name__}, not an X25519 {expected} key; "
                       f"{_KEYGEN_HINT}")


def load_encryption_key(path: str | os.PathLike[str]) -> X25519PublicKey:
    """Load a recipient's PEM X25519 public key (``NAME.pub`` of ``keygen --encryption``).

    Raises:
        ConfigError: If the file is missing, unreadable, not a PEM public key, or a key of
            another kind (an Ed25519 signing key, a private key).
        MissingExtraError: If the 'sign' extra (cryptography) is not installed.
    """
    _need_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    key_path = Path(path)
    data = _read_key_file(key_path, "encryption (public)")
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"{key_path} is a private key; give the recipient's public key "
                          "(the .pub file) to encrypt to, and keep private keys to yourself")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{key_path} is not a PEM public key ({type(exc).__name__}); "
                          f"{_KEYGEN_HINT}") from None
    if not isinstance(key, X25519PublicKey):
        raise _kind_error(key_path, key, "public encryption")
    return key


def load_decryption_key(path: str | os.PathLike[str]) -> X25519PrivateKey:
    """Load a PEM X25519 private key (``NAME.key`` of ``keygen --encryption``).

    Raises:
        ConfigError: If the file is missing, unreadable, not an unencrypted PEM private key,
            or a key of another kind (an Ed25519 signing key, a public key).
        MissingExtraError: If the 'sign' extra (cryptography) is not installed.
    """
    _need_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    key_path = Path(path)
    data = _read_key_file(key_path, "decryption (private)")
    if b"PUBLIC KEY" in data:
        raise ConfigError(f"{key_path} is a public key; decrypting needs the matching "
                          "private key (the .key file of `ckpt keygen --encryption --out DIR`)")
    if key_path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("private key %s is readable by other users; chmod 600 it", key_path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{key_path} is not an unencrypted PEM private key "
                          f"({type(exc).__name__}); {_KEYGEN_HINT}") from None
    if not isinstance(key, X25519PrivateKey):
        raise _kind_error(key_path, key, "private decryption")
    return key


def raw_public(key: X25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def encryption_fingerprint(key: X25519PublicKey) -> str:
    """sha256 (hex) of the raw 32-byte X25519 public key: how recipients are named."""
    return hashlib.sha256(raw_public(key)).hexdigest()
