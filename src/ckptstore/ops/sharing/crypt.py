"""Encryption keys for sealed (encrypted) copies: key pairs and where the parts live.

The key files are read and checked by :mod:`ckptstore.keyfiles` (below the configuration,
which checks ``[tiers] encrypt_to`` with it) and the primitives (AES-256-GCM, the X25519 +
HKDF key wrap) are :mod:`ckptstore.format.crypt`, shared with encrypted tiers; this module
makes a key pair (``ckpt keygen --encryption --out DIR``, beside the Ed25519 signing pairs
of :mod:`ckptstore.ops.sharing.signing`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckptstore.extras import require
from ckptstore.keyfiles import encryption_fingerprint

__all__ = ["generate_encryption_keypair"]

logger = logging.getLogger(__name__)


def generate_encryption_keypair(out_dir: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a new X25519 key pair: ``<name>.key`` (mode 0600) and ``<name>.pub``.

    Returns:
        ``(private key path, public key path)``.

    Raises:
        StorageError: If either file exists (keys are never overwritten) or cannot be
            written.
        InvalidNameError: If ``name`` is not a valid name.
        MissingExtraError: If the 'sign' extra (cryptography) is not installed.
    """
    require("cryptography.hazmat.primitives.ciphers.aead",
            "encrypted copies (keygen --encryption)")
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from ckptstore.names import validate_name
    from ckptstore.ops.sharing.signing import write_key_pair

    validate_name(name, "key name")
    key = X25519PrivateKey.generate()
    private_path, public_path = write_key_pair(out_dir, name, key)
    logger.info("wrote X25519 key pair %s / %s (fingerprint %s)", private_path, public_path,
                encryption_fingerprint(key.public_key()))
    return private_path, public_path
