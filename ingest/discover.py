"""Find input files (file, folder, glob; local or s3://) and open them with transparent decompression."""
from __future__ import annotations

import gzip
import hashlib
import io
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import fsspec

from batchrl.common.fsutil import filesystem_for

#: suffix (after stripping .gz/.zst) -> format name
FORMATS = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
    ".csv": "csv",
}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


@dataclass(frozen=True)
class InputFile:
    uri: str          # full URI (s3://bucket/key or absolute local path)
    size: int         # bytes on storage
    sha256: str       # of the stored bytes: the file's data version
    format: str       # jsonl | parquet | arrow | csv | unknown (needs IngestConfig.reader)
    compression: str | None = None
    error: str | None = None  # why the file could not even be listed/hashed (e.g. permission denied)
    # the path relative to the landing root it was found under: what the data records (``source_file``),
    # so the same logs at another path or on an object store give the same bytes and data versions
    name: str = ""

    @property
    def source(self) -> str:
        return self.name or self.uri

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_format(name: str) -> tuple[str, str | None]:
    lower = name.lower()
    compression = None
    for suffix, comp in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = comp, lower[: -len(suffix)]
            break
    for suffix, fmt in FORMATS.items():
        if lower.endswith(suffix):
            return fmt, compression
    return "unknown", compression


def _with_protocol(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _hidden(path: str) -> bool:
    return any(part.startswith((".", "_")) for part in path.split("/")[-1:])


def relative_name(path: str, root: str) -> str:
    """``path`` relative to the folder ``root`` (both without protocol); its file name when not under it."""
    root = root.rstrip("/")
    return path[len(root) + 1:] if root and path.startswith(root + "/") else path.rsplit("/", 1)[-1]


def discover_inputs(uri: str, storage_options: dict | None = None, include_unknown: bool = False,
                    hash_files: bool = True, root: str | None = None) -> list[InputFile]:
    """List input files under ``uri``, sorted by URI (deterministic).

    ``uri`` may be a file, a folder (searched recursively; hidden/underscore files and, unless
    ``include_unknown``, files of unknown format are skipped), or a glob (every match is kept, so a
    custom reader can be pointed at e.g. ``logs/*.tsv``). Each file is named (``InputFile.name``)
    relative to ``root`` (the landing root; default: the folder ``uri`` is, or lies in).
    """
    fs, path = filesystem_for(uri, storage_options)
    if fs.isfile(path):
        paths, explicit, base = [path], True, path.rsplit("/", 1)[0] if "/" in path else ""
    elif any(ch in path for ch in "*?["):
        paths, explicit = fs.glob(path), True
        base = path[:min(path.find(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0]
    elif fs.isdir(path):
        paths, explicit, base = fs.find(path), False, path
    else:
        raise FileNotFoundError(f"no input at {uri}")
    if root is not None:
        base = filesystem_for(root, storage_options)[1]
    found = []
    for p in sorted(paths):
        if fs.isdir(p) or _hidden(p):
            continue
        fmt, comp = detect_format(p)
        if fmt == "unknown" and not (explicit or include_unknown):
            continue
        size, digest, error = 0, "", None
        try:  # an unreadable file is still listed: the ingest stage reports it (IngestConfig.on_bad_file)
            size = int(fs.info(p)["size"])
            digest = _sha256(fs, p) if hash_files else ""
        except OSError as e:
            error = f"cannot be read at discovery [{type(e).__name__}: {e}]"
        found.append(InputFile(_with_protocol(fs, p), size, digest, fmt, comp, error, relative_name(p, base)))
    return found


def _sha256(fs, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(file: InputFile, storage_options: dict | None = None) -> str:
    """sha256 of the stored bytes (what ``discover_inputs`` records unless ``hash_files=False``)."""
    return _sha256(*filesystem_for(file.uri, storage_options))


class OrderedDigest:
    """sha256 of bytes fed in order, updated on a thread of its own: the reader pays one copy per
    chunk, not the hash (hashlib drops the GIL on large buffers). ``hexdigest`` waits for the rest."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._sha, self._pool, self._pending = hashlib.sha256(), ThreadPoolExecutor(1), []

    def update(self, data) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        if len(self._pending) > 2:  # at most a few chunks in memory
            self._pending.pop(0).result()
        self._pending.append(self._pool.submit(self._sha.update, bytes(data)))  # one worker: in order

    def hexdigest(self) -> str:
        self._pool.shutdown(wait=True)
        return self._sha.hexdigest()


class Digesting(io.RawIOBase):
    """A read-through tap: every stored byte read (before decompression) also updates ``digest``, so a
    file read once from start to end is hashed in the same pass (``digest`` holds its sha256 at EOF)."""

    def __init__(self, raw: BinaryIO, digest):
        self.raw, self.digest = raw, digest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        if n:
            self.digest.update(memoryview(b)[:n])  # hashlib drops the GIL on large buffers
        return n

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


def open_binary(file: InputFile, storage_options: dict | None = None, digest=None) -> BinaryIO:
    """Open the file for streaming reads, decompressing .gz / .zst on the fly; ``digest`` (a hashlib
    object) sees the stored bytes as they are read."""
    fs, path = filesystem_for(file.uri, storage_options)
    raw = fs.open(path, "rb")
    if digest is not None:
        raw = io.BufferedReader(Digesting(raw, digest), buffer_size=1 << 20) if file.compression else Digesting(raw, digest)
    if file.compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if file.compression == "zstd":
        return io.BufferedReader(ZstdStream(raw), buffer_size=1 << 20)
    return raw


class ZstdStream(io.RawIOBase):
    """Streaming zstd decompression that raises ``EOFError`` when the input ends inside a frame
    (``zstandard``'s ``stream_reader`` reports a truncated file as a clean, short end). Concatenated
    frames are read one after the other."""

    def __init__(self, raw: BinaryIO, chunk: int = 1 << 18):
        import zstandard

        self.raw, self.chunk = raw, chunk
        self.dctx = zstandard.ZstdDecompressor()
        self.obj, self.in_frame = self.dctx.decompressobj(), False
        self.out, self.pos, self.done = memoryview(b""), 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.pos >= len(self.out) and not self.done:
            self._fill()
        n = min(len(b), len(self.out) - self.pos)
        b[:n] = self.out[self.pos:self.pos + n]
        self.pos += n
        return n

    def _fill(self) -> None:
        data = self.raw.read(self.chunk)
        if not data:
            if self.in_frame:
                raise EOFError("zstd stream ended inside a frame (truncated file?)")
            self.done = True
            return
        parts = []
        while data:
            self.in_frame = True
            parts.append(self.obj.decompress(data))
            if not self.obj.eof:
                break
            data, self.in_frame = self.obj.unused_data, False  # a frame ended: maybe another one follows
            self.obj = self.dctx.decompressobj()
        self.out, self.pos = memoryview(b"".join(parts)), 0

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()
