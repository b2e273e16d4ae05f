"""A GGUF shipped as ordered raw parts (several data-only wheels, each under PyPI's size limit), joined
once into the cache and verified before any stage loads it.

A part spec is ``distribution:relative/path`` (found through the distribution's RECORD, never imported) or a
plain path. Each part is checked against the sha256 its wheel's RECORD lists (a corrupt or truncated part is
named), the joined file against the expected sha256 the config gives (wrong order or a wrong package is
named). The joined file is content-addressed: ``<cache>/gguf-parts/<sha256[:16]>.gguf``, written to a temp
file and renamed, so a reader never sees half a model and a second run joins nothing. The hash taken while
joining is recorded for the file (``fsutil.note_written_sha256``): the conversion that follows in this process
takes it instead of reading the file again; a later run, or a file changed since, is hashed there and checked
against the expected sha256 (``cached_hf_from_gguf``'s ``expected_sha256``).
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
from dataclasses import asdict, dataclass

from batchrl.common import fsutil
from batchrl.training.models.gguf import GgufSourceError, resolve_gguf

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 22


@dataclass(frozen=True)
class GgufPart:
    """One resolved part: where it is, which package shipped it, and the hash its RECORD promises."""

    spec: str
    path: str
    bytes: int
    package: str | None
    package_version: str | None
    record_sha256: str | None


def _record_sha256(spec: str) -> str | None:
    """The hex sha256 a wheel's RECORD lists for a ``dist:rel`` part (None for a plain path or no hash)."""
    import importlib.metadata as md

    name, sep, rel = spec.partition(":")
    if not sep or os.path.exists(spec):
        return None
    try:
        files = md.distribution(name).files or []
    except md.PackageNotFoundError:
        return None
    entry = next((f for f in files if str(f).replace("\\", "/") == rel.strip("/")), None)
    if entry is None or entry.hash is None or entry.hash.mode != "sha256":
        return None
    return base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()


def resolve_parts(parts: list[str]) -> list[GgufPart]:
    """Every part found, or a GgufSourceError naming the first missing one (before anything is read)."""
    if not parts:
        raise GgufSourceError("gguf_parts is empty: list the parts in order")
    resolved = []
    for i, spec in enumerate(parts, 1):
        try:
            src = resolve_gguf(spec)
        except GgufSourceError as exc:
            raise GgufSourceError(f"GGUF part {i} of {len(parts)} ({spec!r}) is missing: {exc}") from None
        resolved.append(GgufPart(spec=spec, path=src.path, bytes=os.path.getsize(src.path), package=src.package,
                                 package_version=src.package_version, record_sha256=_record_sha256(spec)))
    return resolved


def check_expected_sha256(sha256: str | None) -> str:
    """The expected hash, lower-case; a split GGUF without one is refused (nothing else says it is whole)."""
    if not sha256 or not _SHA256.match(sha256.lower()):
        raise GgufSourceError(f"gguf_sha256 must be the joined file's 64-hex-digit sha256, got {sha256!r}")
    return sha256.lower()


def joined_path(cache_dir: str, sha256: str) -> str:
    return os.path.join(os.path.abspath(cache_dir), "gguf-parts", f"{sha256[:16]}.gguf")


def join_parts(parts: list[str], sha256: str, cache_dir: str) -> tuple[str, dict]:
    """The joined GGUF for ``parts`` (joined on the first call only) and its provenance for the lineage:
    ``{gguf_sha256, gguf_bytes, parts: [{spec, package, package_version, bytes, sha256}]}``."""
    expected = check_expected_sha256(sha256)
    resolved = resolve_parts(parts)
    out = joined_path(cache_dir, expected)
    part_hashes = None
    if not os.path.isfile(out):
        part_hashes = _join_verified(resolved, expected, out)
    provenance = {"gguf_sha256": expected, "gguf_bytes": os.path.getsize(out),
                  "parts": [{**{k: v for k, v in asdict(p).items() if k not in ("path", "record_sha256")},
                             "sha256": (part_hashes[i] if part_hashes else p.record_sha256)}
                            for i, p in enumerate(resolved)]}
    return out, provenance


def _join_verified(parts: list[GgufPart], expected: str, out: str) -> list[str]:
    """Concatenate into a temp file beside ``out`` hashing as it goes; rename only when every part matches its
    RECORD hash and the whole matches ``expected``. Returns each part's sha256."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".join-", suffix=".gguf", dir=os.path.dirname(out))
    whole, part_hashes = hashlib.sha256(), []
    try:
        with os.fdopen(fd, "wb") as sink:
            for i, part in enumerate(parts, 1):
                one = hashlib.sha256()
                with open(part.path, "rb") as fh:
                    while block := fh.read(_CHUNK):
                        one.update(block)
                        whole.update(block)
                        sink.write(block)
                if part.record_sha256 and one.hexdigest() != part.record_sha256:
                    raise GgufSourceError(
                        f"GGUF part {i} ({part.spec!r}, {part.path}) is corrupt: sha256 {one.hexdigest()}, its package "
                        f"{part.package} {part.package_version} records {part.record_sha256}; reinstall it")
                part_hashes.append(one.hexdigest())
        if whole.hexdigest() != expected:
            raise GgufSourceError(
                f"the {len(parts)} GGUF parts joined give sha256 {whole.hexdigest()}, expected {expected}: a part is "
                f"wrong, missing or out of order ({', '.join(p.spec for p in parts)})")
        os.replace(tmp, out)
        # its hash is known from the join: converting it (``cached_hf_from_gguf``) does not read 1.1 GB again
        fsutil.note_written_sha256(out, expected)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return part_hashes
