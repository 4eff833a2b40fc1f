"""Ed25519 signatures over checkpoints: who vouches for this exact content.

A signature covers the checkpoint id and its manifest digest. The manifest holds the
blake3 of every chunk, so a valid signature pins every byte of the state: change a chunk and
loading fails its hash check; change the manifest and its digest no longer matches the
signed one. The signature is stored twice: as ``SIGNATURE`` beside ``manifest.json`` in the
hot copy (it travels with bundles), and in a ``signed`` catalog event (so copies restored
from an archive tier, which carry only the checkpoint's own files, can still be checked).

The signed digest is always the checkpoint's **original** manifest digest (the catalog's
``manifest_digest``: the identity of the content). A hot copy restored from a copy
re-encoded with the archive codec has another manifest; it carries the original manifest
bytes too, and :func:`ckptstore.ops.tiering.reencode.read_copy_manifest` checks that they have the
signed digest and describe the same chunks (same blake3), so the signature covers the
re-encoded copy as well.

Keys are PEM files: PKCS#8 private keys (unencrypted; keep them with mode 0600) and
SubjectPublicKeyInfo public keys, as written by :func:`generate_keypair` (``ckpt keygen``).
Private key material never reaches the catalog, logs or errors; the public key's
fingerprint (sha256, hex) names the signer.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.core import StoreCore
from ckptstore.durable import replace_file, write_new_file
from ckptstore.errors import CheckpointNotFoundError, ConfigError, IntegrityError, StorageError
from ckptstore.extras import require
from ckptstore.format.constants import SIGNATURE_NAME
from ckptstore.records import Checkpoint, ReplicaState, expected_digest

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from ckptstore.format import Manifest

__all__ = [
    "SIGNATURE_NAME",
    "SignatureDoc",
    "check_signature",
    "generate_keypair",
    "key_fingerprint",
    "load_private_key",
    "load_public_key",
    "sign_checkpoint",
    "signature_payload",
    "verify_signature",
]

logger = logging.getLogger(__name__)

_FORMAT = "ckptstore-signature"
_VERSION = 1
_MAX_DOC = 64 * 1024
_MAX_KEY_FILE = 64 * 1024


def signature_payload(ckpt_id: str, manifest_digest: str) -> bytes:
    """The exact bytes signed: a domain tag, the checkpoint id and its manifest digest."""
    return b"ckptstore-signature-v1\0" + ckpt_id.encode("ascii") + b"\0" + \
        manifest_digest.encode("ascii")


@dataclass(frozen=True)
class SignatureDoc:
    """A parsed ``SIGNATURE`` document.

    Attributes:
        checkpoint_id: The signed checkpoint.
        manifest_digest: The signed manifest digest.
        key_fingerprint: sha256 (hex) of the signer's raw public key.
        signature: The 64-byte Ed25519 signature.
        signed_at: ISO-8601 time of signing (informational, not signed).
    """

    checkpoint_id: str
    manifest_digest: str
    key_fingerprint: str
    signature: bytes
    signed_at: str

    def to_json(self) -> bytes:
        """The document as stored (JSON, sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=1).encode("ascii")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (also the ``signed`` event's detail)."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "algorithm": "ed25519",
            "checkpoint_id": self.checkpoint_id,
            "manifest_digest": self.manifest_digest,
            "key_fingerprint": self.key_fingerprint,
            "signature": base64.b64encode(self.signature).decode("ascii"),
            "signed_at": self.signed_at,
        }

    @classmethod
    def parse(cls, data: bytes | dict[str, Any]) -> SignatureDoc:
        """Parse (and bound) a document from bytes or its dict form.

        Raises:
            IntegrityError: If it is not a well-formed ckptstore Ed25519 signature.
        """
        try:
            if isinstance(data, bytes):
                if len(data) > _MAX_DOC:
                    raise ValueError(f"{len(data)} bytes is too large for a signature")
                data = json.loads(data)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            if (data.get("format"), data.get("version"), data.get("algorithm")) != (
                _FORMAT, _VERSION, "ed25519"
            ):
                raise ValueError("not a version 1 ckptstore ed25519 signature")
            fields = [data.get(k) for k in ("checkpoint_id", "manifest_digest",
                                             "key_fingerprint", "signature")]
            if not all(isinstance(f, str) and 0 < len(f) <= 256 for f in fields):
                raise ValueError("missing or oversized fields")
            raw = base64.b64decode(str(data["signature"]), validate=True)
            if len(raw) != 64:
                raise ValueError("an Ed25519 signature has 64 bytes")
            return cls(str(data["checkpoint_id"]), str(data["manifest_digest"]),
                       str(data["key_fingerprint"]), raw, str(data.get("signed_at", "")))
        except (ValueError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
            raise IntegrityError(
                f"the checkpoint signature is malformed ({exc}); sign the checkpoint again "
                "with `ckpt sign`"
            ) from None


# ---------------------------------------------------------------------- keys
def _read_key_file(path: Path, what: str) -> bytes:
    try:
        if path.stat().st_size > _MAX_KEY_FILE:
            raise ConfigError(f"{path} is too large to be a {what} key file")
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the {what} key {path}: {exc.strerror}; generate a key pair with "
            "`ckpt keygen --out DIR`"
        ) from exc


def _need_cryptography() -> None:
    """Raise the error naming the 'sign' extra when cryptography is not installed."""
    require("cryptography.hazmat.primitives.asymmetric.ed25519",
            "signing (ckpt sign, verify-signature, keygen)")


def _x25519_hint(key: object) -> str:
    """What to say when an encryption key is given where a signing key is expected."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )

    if isinstance(key, X25519PrivateKey | X25519PublicKey):
        return (" (it is an X25519 encryption key of `ckpt keygen --encryption --out DIR`: "
                "encryption keys encrypt, they cannot sign)")
    return ""


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load an unencrypted PEM (PKCS#8) Ed25519 private key.

    Raises:
        ConfigError: If the file is missing, unreadable or not an Ed25519 private key.
        MissingExtraError: If the 'sign' extra (cryptography) is not installed.
    """
    _need_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key_path = Path(path)
    data = _read_key_file(key_path, "private")
    mode = key_path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("private key %s is readable by other users; chmod 600 it", key_path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        # The message of a failed parse never includes key material.
        raise ConfigError(
            f"{key_path} is not an unencrypted PEM private key ({type(exc).__name__}); "
            "generate one with `ckpt keygen --out DIR`"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{key_path} holds a {type(key).__name__}, not an Ed25519 signing "
                          f"key{_x25519_hint(key)}; ckptstore signs with Ed25519 keys "
                          "(`ckpt keygen --out DIR`)")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Load a PEM Ed25519 public key.

    Raises:
        ConfigError: If the file is missing, unreadable or not an Ed25519 public key.
        MissingExtraError: If the 'sign' extra (cryptography) is not installed.
    """
    _need_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key_path = Path(path)
    data = _read_key_file(key_path, "public")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{key_path} is not a PEM public key ({type(exc).__name__}); use the .pub file "
            "written by `ckpt keygen`"
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{key_path} holds a {type(key).__name__}, not an Ed25519 key"
                          f"{_x25519_hint(key)}; signatures are checked with the .pub file of "
                          "`ckpt keygen --out DIR`")
    return key


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """sha256 (hex) of the raw 32-byte public key: how signers are named."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def write_key_pair(out_dir: str | os.PathLike[str], name: str, key: Any) -> tuple[Path, Path]:
    """Write ``key`` (an Ed25519 or X25519 private key) as ``NAME.key`` (PKCS#8 PEM, mode
    0600) and its public half as ``NAME.pub`` (SubjectPublicKeyInfo PEM) in ``out_dir``.

    Both names are checked before either is written, so a refusal leaves no half pair.

    Raises:
        StorageError: If either file exists (keys are never overwritten) or the files
            cannot be written.
    """
    from cryptography.hazmat.primitives import serialization

    directory = Path(out_dir)
    private_path, public_path = directory / f"{name}.key", directory / f"{name}.pub"
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot write keys to {directory}: "
                                           f"{exc.strerror}") from exc
    exists = "exists; keys are never overwritten, choose another --out or --name"
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise StorageError(errno.EEXIST, f"{path} {exists}")
    for path, data, mode in ((private_path, private, 0o600), (public_path, public, 0o644)):
        try:
            write_new_file(path, data, mode=mode)
        except StorageError as exc:
            if exc.errno != errno.EEXIST:
                raise
            raise StorageError(exc.errno, f"{path} {exists}") from exc
    return private_path, public_path


def generate_keypair(out_dir: str | os.PathLike[str], name: str = "ckpt-signing") -> \
        tuple[Path, Path]:
    """Write a new Ed25519 key pair: ``<name>.key`` (mode 0600) and ``<name>.pub``.

    Args:
        out_dir: Directory to write into (created if needed).
        name: File name stem.

    Returns:
        ``(private key path, public key path)``.

    Raises:
        StorageError: If either file exists (keys are never overwritten) or the files
            cannot be written.
        MissingExtraError: If the 'sign' extra (cryptography) is not installed.
    """
    _need_cryptography()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ckptstore.names import validate_name

    validate_name(name, "key name")
    key = Ed25519PrivateKey.generate()
    private_path, public_path = write_key_pair(out_dir, name, key)
    logger.info("wrote Ed25519 key pair %s / %s (fingerprint %s)", private_path, public_path,
                key_fingerprint(key.public_key()))
    return private_path, public_path


# ---------------------------------------------------------------------- sign / verify
def _hot_dir(store: StoreCore, ck: Checkpoint) -> Path | None:
    replica = ck.replica("hot")
    if replica is None or replica.state != ReplicaState.PRESENT:
        return None
    return store.checkpoint_dir(ck.run, ck.id)


def _hot_manifest(directory: Path, ck: Checkpoint) -> Manifest:
    """The hot copy's manifest, checked to hold the checkpoint's original content.

    The copy may be a re-encoded one (restored from the archive codec's copy): then its own
    manifest is checked against the replica's digest and its original manifest against the
    checkpoint's (:func:`ckptstore.ops.tiering.reencode.read_copy_manifest`).
    """
    from ckptstore.ops.tiering.reencode import read_copy_manifest

    if ck.manifest_digest is None:
        raise IntegrityError(f"checkpoint {ck.ref} has no manifest digest in the catalog")
    return read_copy_manifest(directory, ck.manifest_digest, expected_digest(ck, "hot"))


def sign_checkpoint(
    store: StoreCore, ref: str, private_key_path: str | os.PathLike[str]
) -> Path:
    """Sign a committed checkpoint's id and manifest digest with an Ed25519 key.

    The manifest on the hot tier is read and checked against the catalog's digest first,
    so only content the catalog vouches for is ever signed. The signed digest is the
    checkpoint's own (original) manifest digest, also when the hot copy is a re-encoded one
    (whose original manifest is checked to match, chunk by chunk).

    Args:
        store: The open store.
        ref: Checkpoint reference.
        private_key_path: PEM private key (``ckpt keygen``).

    Returns:
        The path of the ``SIGNATURE`` file written beside ``manifest.json``.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve, or the checkpoint has no
            hot copy (restore it first).
        IntegrityError: If the hot manifest does not match the catalog.
        ConfigError: If the key cannot be loaded.
        StorageError: If the file cannot be written.
    """
    key = load_private_key(private_key_path)
    ck = store.catalog.get(ref)
    directory = _hot_dir(store, ck)
    if directory is None:
        raise CheckpointNotFoundError(
            f"checkpoint {ck.ref} ({ck.id}) has no copy on the hot tier to sign; restore it "
            f"first with `ckpt restore {ck.ref}`"
        )
    _hot_manifest(directory, ck)
    digest = ck.manifest_digest
    assert digest is not None  # checked by _hot_manifest
    doc = SignatureDoc(
        checkpoint_id=ck.id,
        manifest_digest=digest,
        key_fingerprint=key_fingerprint(key.public_key()),
        signature=key.sign(signature_payload(ck.id, digest)),
        signed_at=datetime.now(UTC).isoformat(),
    )
    path = directory / SIGNATURE_NAME
    replace_file(path, doc.to_json())
    store.catalog.record_event("signed", checkpoint_id=ck.id, detail=doc.to_dict())
    logger.info("signed %s (%s) with key %s", ck.ref, ck.id, doc.key_fingerprint[:16])
    return path


def _find_signature(store: StoreCore, ck: Checkpoint, fingerprint: str) -> SignatureDoc:
    """The checkpoint's signature by the key ``fingerprint``: the file, else the events."""
    directory = _hot_dir(store, ck)
    found: SignatureDoc | None = None
    if directory is not None:
        from ckptstore.format.fsio import read_all

        path = directory / SIGNATURE_NAME
        try:
            # No link following, and a FIFO planted in its place cannot block us.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise IntegrityError(f"{path} is not a regular file; remove it and sign "
                                         "the checkpoint again")
                found = SignatureDoc.parse(read_all(fd, _MAX_DOC + 1))
            finally:
                os.close(fd)
        except FileNotFoundError:
            found = None
        except OSError as exc:
            raise StorageError(exc.errno or 5, f"cannot read {path}: {exc.strerror}") from exc
    if found is not None and found.key_fingerprint == fingerprint:
        return found
    for event in store.catalog.events(ck.id, limit=1000):
        if event.kind == "signed" and event.detail.get("key_fingerprint") == fingerprint:
            return SignatureDoc.parse(dict(event.detail))
    if found is not None:
        raise IntegrityError(
            f"checkpoint {ck.ref} ({ck.id}) is signed by key {found.key_fingerprint[:16]}..., "
            f"not by the given key {fingerprint[:16]}...; check that you trust the right key"
        )
    raise IntegrityError(
        f"checkpoint {ck.ref} ({ck.id}) is not signed; sign it with `ckpt sign {ck.ref} "
        "--key KEY` or load it without requiring a signature"
    )


def check_signature(doc: SignatureDoc, ckpt_id: str, manifest_digest: str,
                    public_key: Ed25519PublicKey) -> None:
    """Check a signature document against an id, a manifest digest and a public key.

    Raises:
        IntegrityError: If the document is for another checkpoint or manifest, or the
            signature does not verify (tampered, or made with another key).
    """
    from cryptography.exceptions import InvalidSignature

    if doc.checkpoint_id != ckpt_id or doc.manifest_digest != manifest_digest:
        raise IntegrityError(
            f"the signature is for checkpoint {doc.checkpoint_id} with manifest "
            f"{doc.manifest_digest[:16]}..., not for {ckpt_id} with manifest "
            f"{manifest_digest[:16]}...: the checkpoint or its signature was replaced"
        )
    try:
        public_key.verify(doc.signature, signature_payload(ckpt_id, manifest_digest))
    except InvalidSignature:
        raise IntegrityError(
            f"the signature of checkpoint {ckpt_id} does not verify with key "
            f"{key_fingerprint(public_key)[:16]}...: the signature was tampered with or made "
            "with another key; do not use this checkpoint"
        ) from None


def _rehash_a_copy(store: StoreCore, ck: Checkpoint) -> None:
    """Re-hash every chunk of the fastest PRESENT, readable copy of ``ck`` (hot first).

    Raises:
        IntegrityError: If the copy is damaged, or there is no such copy to re-hash.
    """
    from ckptstore.format import verify_checkpoint
    from ckptstore.ops.tiering.reencode import check_original, original_manifest_bytes
    from ckptstore.ops.tiering.replicas import manifest_on, run_resolver
    from ckptstore.storage.transfer import content_problems, is_reencoded

    assert ck.manifest_digest is not None
    directory = _hot_dir(store, ck)
    if directory is not None:
        problems = verify_checkpoint(directory, _hot_manifest(directory, ck),
                                     locate=store.locate, deep=True)
        where = "hot"
    else:
        tiers = store.settings.tier_urls()
        present = [r.tier for r in ck.replicas if r.state == ReplicaState.PRESENT
                   and r.tier in ("warm", "cold") and r.tier in tiers]
        readable = [store.tier(name) for name in sorted(present, key=("warm", "cold").index)]
        readable = [t for t in readable if t.readable]
        if not readable:
            states = ", ".join(f"{r.tier}:{r.state}" for r in ck.replicas) or "none"
            raise IntegrityError(
                f"checkpoint {ck.ref} ({ck.id}) carries a valid signature, but no copy of it "
                f"can be re-hashed (replicas: {states}): --deep vouches for nothing without "
                "one. Run `ckpt verify` to repair a damaged copy, or `ckpt restore` it")
        tier = readable[0]
        manifest = manifest_on(tier, ck, use_cache=False)
        if is_reencoded(manifest):
            check_original(manifest, original_manifest_bytes(tier, ck.run, manifest,
                                                             ck.manifest_digest),
                           ck.manifest_digest)
        run_of = run_resolver(store, ck)
        problems = content_problems(
            tier, manifest, lambda owner, rel: tier.key_for(run_of(owner), owner, rel))
        where = tier.name
    if problems:
        raise IntegrityError(
            f"checkpoint {ck.ref} is signed, but its {where} copy is damaged: "
            + "; ".join(problems[:3]) + "; run `ckpt verify` to repair it"
        )


def verify_signature(
    store: StoreCore,
    ref: str,
    public_key_path: str | os.PathLike[str],
    *,
    deep: bool = False,
) -> None:
    """Check that a committed checkpoint carries a valid signature by the given key.

    Checks, in order: the signature document (file beside the manifest, else the ``signed``
    event) names this checkpoint and the catalog's manifest digest; the Ed25519 signature
    verifies; the manifest on the hot tier has that digest (for a re-encoded hot copy: its
    original manifest has it and describes the same chunks); with ``deep``, every chunk of
    a readable copy (the hot one, else the fastest other PRESENT one) decodes to the content
    the manifest's blake3 records. A signature proves the manifest, the manifest's digests
    prove the bytes: ``deep`` vouches for both, or fails (a checkpoint whose only copy is
    DAMAGED fails).

    Args:
        store: The open store.
        ref: Checkpoint reference.
        public_key_path: PEM public key of the trusted signer.
        deep: Also re-hash every chunk of a readable copy (IntegrityError when there is no
            PRESENT copy to read).

    Raises:
        IntegrityError: If the checkpoint is unsigned, signed by another key, or anything
            (signature, manifest, chunks) was tampered with.
        CheckpointNotFoundError: If the reference does not resolve.
        ConfigError: If the key cannot be loaded.
    """
    public_key = load_public_key(public_key_path)
    ck = store.catalog.get(ref)
    if ck.manifest_digest is None:
        raise IntegrityError(f"checkpoint {ck.ref} has no manifest digest in the catalog")
    doc = _find_signature(store, ck, key_fingerprint(public_key))
    check_signature(doc, ck.id, ck.manifest_digest, public_key)
    if ck.parted:
        # Saved across hosts: the manifest every part is read with is the catalog's,
        # checked against the signed digest here; with deep, so is every part on this host.
        from ckptstore.ops.tiering.parts import parted_manifest, verify_parts_here

        parted_manifest(store, ck)
        problems = verify_parts_here(store, ck, deep=True) if deep else []
        if problems:
            raise IntegrityError(
                f"checkpoint {ck.ref} is signed, but a part on this host is damaged: "
                + "; ".join(problems[:3])
            )
        directory = None
    elif deep:
        _rehash_a_copy(store, ck)
    else:
        directory = _hot_dir(store, ck)
        if directory is not None:
            _hot_manifest(directory, ck)
    logger.info("signature of %s (%s) verified with key %s", ck.ref, ck.id,
                doc.key_fingerprint[:16])
