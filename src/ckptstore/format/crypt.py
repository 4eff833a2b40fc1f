"""Encryption primitives of sealed (encrypted) copies: AES-256-GCM and the key wrap.

A sealed copy (:mod:`ckptstore.format.sealed`) is encrypted under a fresh random 256-bit
**data key**, used for that copy only. The data key is **wrapped** once per recipient: an
ephemeral X25519 key pair agrees a secret with the recipient's X25519 public key,
HKDF-SHA256 turns it into a key-encryption key, and AES-256-GCM encrypts the data key under
it. Only the holder of a recipient's private key can unwrap it; the wrap names no recipient
(a reader tries each wrapped key, and AES-GCM's tag tells which one is theirs).

Everything else is AES-256-GCM under the data key with a random 96-bit nonce per object
and associated data (AAD) that binds each ciphertext to its place (:func:`object_aad`): an
object cannot be swapped for another one of the same copy, or of another copy.

In the format layer because every sealed copy uses it: pushes and bundles
(:mod:`ckptstore.ops.sharing.sealed`) and encrypted tiers
(:mod:`ckptstore.ops.tiering.sealed_tier`). Key files are read by :mod:`ckptstore.keyfiles`.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptstore.errors import DecryptionError
from ckptstore.keyfiles import encryption_fingerprint, raw_public

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = [
    "DATA_KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "WrappedKey",
    "b64",
    "decrypt",
    "encrypt",
    "new_data_key",
    "new_nonce",
    "object_aad",
    "unb64",
    "unwrap_data_key",
    "wrap_data_key",
]

#: AES-256 keys.
DATA_KEY_BYTES = 32
#: AES-GCM's standard 96-bit nonce.
NONCE_BYTES = 12
#: AES-GCM's 128-bit tag, appended to every ciphertext.
TAG_BYTES = 16
_DOMAIN = b"ckptstore-sealed-v1"


# ---------------------------------------------------------------------- primitives
def new_data_key() -> bytes:
    """A fresh random AES-256 key (one per sealed copy, never reused)."""
    return os.urandom(DATA_KEY_BYTES)


def new_nonce() -> bytes:
    """A fresh random 96-bit nonce (one per encrypted object)."""
    return os.urandom(NONCE_BYTES)


def object_aad(copy_id: str, role: str, name: str = "") -> bytes:
    """Associated data binding a ciphertext to its copy, its role and its name.

    ``role`` is ``index`` (the copy's encrypted index) or ``object`` (one file of the
    checkpoint, ``name`` its path inside the checkpoint): moving a ciphertext to another
    place, or into another copy, fails its tag check.
    """
    return b"\0".join((_DOMAIN, role.encode("ascii"), copy_id.encode("ascii"),
                       name.encode("utf-8")))


def encrypt(key: bytes, nonce: bytes, data: bytes | bytearray | memoryview,
            aad: bytes) -> bytes:
    """AES-256-GCM: ciphertext with its 16-byte tag appended."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key).encrypt(nonce, bytes(data) if isinstance(data, memoryview) else data,
                               aad)


def decrypt(key: bytes, nonce: bytes, data: bytes, aad: bytes, what: str) -> bytes:
    """Open an AES-256-GCM ciphertext, or say which object failed and why it may have.

    Raises:
        DecryptionError: If the tag does not verify (altered, truncated, moved or not
            encrypted under ``key``).
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(nonce) != NONCE_BYTES or len(data) < TAG_BYTES:
        raise DecryptionError(f"{what} is truncated ({len(data)} bytes, an encrypted object "
                              f"has at least {TAG_BYTES}); the copy is damaged")
    try:
        return AESGCM(key).decrypt(nonce, data, aad)
    except InvalidTag:
        raise DecryptionError(
            f"{what} does not decrypt: its ciphertext was altered, truncated or moved from "
            "elsewhere (AES-GCM tag mismatch); nothing of it was used. Fetch the copy again "
            "from its source"
        ) from None


def b64(data: bytes) -> str:
    """Base64 text of ``data`` (metadata documents are JSON)."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: object, size: int | None, what: str) -> bytes:
    """Bytes of base64 ``text`` (of exactly ``size`` bytes when given), or DecryptionError."""
    try:
        if not isinstance(text, str) or len(text) > 4096:
            raise ValueError("not a short string")
        data = base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise DecryptionError(f"{what} is malformed (not base64); the copy is damaged") from None
    if size is not None and len(data) != size:
        raise DecryptionError(f"{what} has {len(data)} bytes, expected {size}; the copy is "
                              "damaged")
    return data


@dataclass(frozen=True)
class WrappedKey:
    """The data key wrapped for one recipient.

    Attributes:
        ephemeral: Raw 32-byte X25519 public key of the one-time key pair.
        nonce: AES-GCM nonce of the wrap.
        wrapped: The data key encrypted under the key-encryption key, tag appended.
    """

    ephemeral: bytes
    nonce: bytes
    wrapped: bytes

    def to_dict(self) -> dict[str, str]:
        """JSON form (in the copy's envelope)."""
        return {"epk": b64(self.ephemeral), "nonce": b64(self.nonce),
                "key": b64(self.wrapped)}

    @classmethod
    def parse(cls, data: object) -> WrappedKey:
        """Parse a recipient entry of an envelope.

        Raises:
            DecryptionError: If it is malformed.
        """
        if not isinstance(data, dict):
            raise DecryptionError("a wrapped key of the copy is malformed; the copy is damaged")
        return cls(unb64(data.get("epk"), 32, "a wrapped key's ephemeral key"),
                   unb64(data.get("nonce"), NONCE_BYTES, "a wrapped key's nonce"),
                   unb64(data.get("key"), DATA_KEY_BYTES + TAG_BYTES, "a wrapped key"))


def _kek(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    """HKDF-SHA256 of the X25519 secret, salted with both public keys."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=DATA_KEY_BYTES, salt=ephemeral + recipient,
                info=_DOMAIN + b"\0key-wrap").derive(shared)


def wrap_data_key(data_key: bytes, recipient: X25519PublicKey, copy_id: str) -> WrappedKey:
    """Wrap ``data_key`` for ``recipient`` (X25519 + HKDF-SHA256 + AES-256-GCM)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    ephemeral = X25519PrivateKey.generate()
    epk, rpk = raw_public(ephemeral.public_key()), raw_public(recipient)
    kek = _kek(ephemeral.exchange(recipient), epk, rpk)
    nonce = new_nonce()
    return WrappedKey(epk, nonce, encrypt(kek, nonce, data_key, object_aad(copy_id, "wrap")))


def unwrap_data_key(wrapped: list[WrappedKey], key: X25519PrivateKey, copy_id: str,
                    what: str) -> bytes:
    """The data key, from whichever of ``wrapped`` was wrapped for ``key``.

    Raises:
        DecryptionError: If none was (the copy was not encrypted to this key).
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    rpk = raw_public(key.public_key())
    for entry in wrapped:
        try:
            shared = key.exchange(X25519PublicKey.from_public_bytes(entry.ephemeral))
            kek = _kek(shared, entry.ephemeral, rpk)
            return AESGCM(kek).decrypt(entry.nonce, entry.wrapped, object_aad(copy_id, "wrap"))
        except (InvalidTag, ValueError):
            continue
    raise DecryptionError(
        f"{what} was not encrypted to the key {encryption_fingerprint(key.public_key())[:16]}"
        f"...: none of its {len(wrapped)} wrapped key(s) opens with it. Use the private key "
        "of one of its recipients (--key, CKPT_DECRYPT_KEY or `decrypt_key` in the config), "
        "or ask the sender to encrypt it to your public key"
    )
