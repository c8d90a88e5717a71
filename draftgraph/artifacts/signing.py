"""Signing an artifact's manifest (`draftgraph build --sign-key FILE`) and checking it (`--verify-key FILE`).

The signature is an HMAC-SHA256 (standard library: hmac, hashlib) of the manifest's exact bytes, written
as hex into `manifest.sig` beside it. The manifest lists a SHA-256 per file, so a good signature vouches for
every listed file. Checksums alone detect corruption only (anyone who can write the directory can
recompute them); the signature detects tampering as long as its key is kept apart from the directory.

A key file holds raw bytes, at least 16 of them; make one with `head -c 32 /dev/urandom > key` and keep
it where the artifact directory's writers cannot read it. The same key signs and verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

SIG = "manifest.sig"
MIN_KEY_BYTES = 16


class SignatureError(ValueError):
    """A key that cannot be used, or a manifest whose signature is absent or does not match."""


def read_key(key) -> bytes:
    """The key's bytes: `key` is the bytes themselves or a key file's path."""
    if isinstance(key, (bytes, bytearray)):
        data = bytes(key)
        where = "the key"
    else:
        where = f"key file {os.fspath(key)}"
        try:
            data = Path(key).read_bytes()
        except OSError as e:
            raise SignatureError(
                f"{where} cannot be read ({e.strerror}); make one with `head -c 32 /dev/urandom > key`"
            ) from e
    if len(data) < MIN_KEY_BYTES:
        raise SignatureError(
            f"{where} holds {len(data)} bytes; a key needs at least {MIN_KEY_BYTES} random bytes "
            "(make one with `head -c 32 /dev/urandom > key`)"
        )
    return data


def signature(manifest_bytes: bytes, key: bytes) -> str:
    return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()


def sign_manifest(directory: str, key: bytes) -> str:
    """Write directory/manifest.sig for the manifest as it is on disk; returns the signature's path."""
    from draftgraph.artifacts.ranks import MANIFEST

    root = Path(directory)
    sig = signature((root / MANIFEST).read_bytes(), key)
    (root / SIG).write_text(sig + "\n")
    return str(root / SIG)


def verify(directory: str, manifest_bytes: bytes, key: bytes) -> None:
    """Raise SignatureError unless directory/manifest.sig is the signature of `manifest_bytes` under `key`."""
    sig_file = Path(directory) / SIG
    if sig_file.is_symlink() or not sig_file.is_file():
        raise SignatureError(
            f"artifacts in {directory} are not signed (no {SIG}) but a verify key was given; sign them with "
            "`draftgraph build --sign-key FILE`, or load them without a verify key"
        )
    found = sig_file.read_bytes().strip()
    want = signature(manifest_bytes, key).encode()
    if not hmac.compare_digest(found, want):
        raise SignatureError(
            f"{directory}/{SIG} does not match the manifest under the verify key (altered after signing, or "
            "signed with another key); nothing else in the directory was read. Rebuild and sign the artifacts"
        )
