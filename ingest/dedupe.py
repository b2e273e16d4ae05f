"""The exact-dedupe key set, in memory bounded by configuration rather than by the input.

Keys are the 64-bit content keys of rows already kept. Recent keys live in RAM as sorted numpy runs
(merged like an LSM tree). Past ``memory_keys`` they are written to a sorted run file on disk (a
temporary folder); RAM keeps one fence per 4 KiB page of it (every 512th key). A fixed-size Bloom
filter over the spilled keys (3 hashes by double hashing of the key's two halves) screens lookups:
only its positives — true duplicates plus the false-positive rate — are looked up on disk, one
``os.pread`` of one page per key and run (served by the page cache, not held by the process). When
``max_disk_runs`` runs exist they are merged into one by a streaming two-way merge (bounded chunks).

Memory: about 2 x ``memory_keys`` x 8 bytes (a merge) + ``bloom_bits`` / 8 + 8 bytes per 512 spilled
keys. Lookup cost grows with the number of disk runs and with the Bloom false-positive rate (for the
default 2^27 bits, 16 MB: ~0.8% at 10M spilled keys, ~3% at 20M, ~25% at 60M), never at the expense of
correctness.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

PAGE_KEYS = 512  # 4 KiB pages of uint64 keys
_KEY = np.dtype("<u8")


class _DiskRun:
    """A sorted run of keys in a file, with the first key of every page in memory."""

    def __init__(self, path: str, n: int, fences: np.ndarray, last: int):
        self.path, self.n, self.fences, self.last = path, n, fences, last
        self.fd = os.open(path, os.O_RDONLY)

    @classmethod
    def write(cls, keys: np.ndarray, directory: str) -> "_DiskRun":
        fd, path = tempfile.mkstemp(dir=directory, suffix=".keys")
        with os.fdopen(fd, "wb") as f:
            f.write(keys.astype(_KEY, copy=False).tobytes())
        return cls(path, len(keys), keys[::PAGE_KEYS].copy(), int(keys[-1]))

    def read(self, start: int, count: int) -> np.ndarray:
        data = os.pread(self.fd, count * 8, start * 8)
        return np.frombuffer(data, _KEY)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """``keys`` sorted: one page read per distinct page that may hold one of them."""
        hit = np.zeros(len(keys), bool)
        inside = np.flatnonzero((keys >= self.fences[0]) & (keys <= self.last))
        if not len(inside):
            return hit
        pages = np.searchsorted(self.fences, keys[inside], side="right") - 1
        distinct, starts = np.unique(pages, return_index=True)  # pages are sorted with the keys
        for page, lo, hi in zip(distinct.tolist(), starts.tolist(), [*starts[1:].tolist(), len(pages)]):
            page_keys = self.read(page * PAGE_KEYS, PAGE_KEYS)
            rows = inside[lo:hi]
            pos = np.minimum(np.searchsorted(page_keys, keys[rows]), len(page_keys) - 1)
            hit[rows] = page_keys[pos] == keys[rows]
        return hit

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def _merge_runs(a: _DiskRun, b: _DiskRun, directory: str, chunk: int = 1 << 18) -> _DiskRun:
    """Streaming merge of two disjoint sorted runs into a new run file; memory ~ 4 chunks."""
    fd, path = tempfile.mkstemp(dir=directory, suffix=".keys")
    fences, written, last = [], 0, 0
    buf_a, buf_b = a.read(0, chunk), b.read(0, chunk)
    pos_a, pos_b = len(buf_a), len(buf_b)
    with os.fdopen(fd, "wb") as out:
        while len(buf_a) or len(buf_b):
            if len(buf_a) and len(buf_b):  # emit everything up to the smaller of the two buffer ends
                limit = min(buf_a[-1], buf_b[-1])
                ca, cb = np.searchsorted(buf_a, limit, "right"), np.searchsorted(buf_b, limit, "right")
            else:
                ca, cb = len(buf_a), len(buf_b)
            merged = np.concatenate((buf_a[:ca], buf_b[:cb]))
            merged.sort(kind="stable")
            first_fence = (-written) % PAGE_KEYS  # fence positions continue across chunks
            fences.append(merged[first_fence::PAGE_KEYS])
            out.write(merged.tobytes())
            written += len(merged)
            last = int(merged[-1]) if len(merged) else last
            buf_a, buf_b = buf_a[ca:], buf_b[cb:]
            if len(buf_a) < chunk // 2 and pos_a < a.n:
                more = a.read(pos_a, chunk)
                pos_a += len(more)
                buf_a = np.concatenate((buf_a, more))
            if len(buf_b) < chunk // 2 and pos_b < b.n:
                more = b.read(pos_b, chunk)
                pos_b += len(more)
                buf_b = np.concatenate((buf_b, more))
    return _DiskRun(path, written, np.concatenate(fences), last)


class SeenKeys:
    """Exact set of uint64 keys: ``contains`` then ``add`` the new ones (see the module doc)."""

    def __init__(self, memory_keys: int = 1 << 19, bloom_bits: int = 1 << 27, max_run: int = 1 << 22,
                 max_disk_runs: int = 4, spill_dir: str | None = None):
        self.runs: list[np.ndarray] = []
        self.disk: list[_DiskRun] = []
        self.memory_keys, self.max_run, self.max_disk_runs = memory_keys, max_run, max_disk_runs
        self.bloom_bits = bloom_bits
        self.bloom: np.ndarray | None = None  # allocated at the first spill
        self.spill_dir, self._tmp = spill_dir, None

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs) + sum(r.n for r in self.disk)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """``keys``: sorted and unique (``np.unique`` output)."""
        hit = np.zeros(len(keys), bool)
        for run in self.runs:
            idx = np.minimum(np.searchsorted(run, keys), len(run) - 1)
            hit |= run[idx] == keys
        if self.disk:
            candidates = np.flatnonzero(~hit & self._maybe(keys))
            if len(candidates):
                sub, found = keys[candidates], np.zeros(len(candidates), bool)
                for run in self.disk:
                    found |= run.contains(sub)
                hit[candidates] = found
        return hit

    def add(self, keys: np.ndarray) -> None:
        """``keys``: unique and not in the set yet. In-memory runs merge when the newer one is at least
        half the size of the one before (a stable sort of two sorted runs is a linear merge)."""
        if len(keys):
            self.runs.append(keys if np.all(keys[1:] > keys[:-1]) else np.sort(keys))
        while (len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1])
               and len(self.runs[-2]) + len(self.runs[-1]) <= self.max_run):
            last = self.runs.pop()
            merged = np.concatenate((self.runs[-1], last))
            merged.sort(kind="stable")
            self.runs[-1] = merged
        if sum(len(r) for r in self.runs) > self.memory_keys:
            self._spill()

    def close(self) -> None:
        for run in self.disk:
            run.close()
        self.disk = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- spilling ------------------------------------------------------------------------------
    def _spill(self) -> None:
        merged = np.concatenate(self.runs)
        merged.sort(kind="stable")
        self.runs = []
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="batchrl-dedupe-", dir=self.spill_dir)
        if self.bloom is None:
            self.bloom = np.zeros(self.bloom_bits // 8, np.uint8)
        positions = self._positions(merged)
        np.bitwise_or.at(self.bloom, positions >> 3, (1 << (positions & 7)).astype(np.uint8))
        self.disk.append(_DiskRun.write(merged, self._tmp))
        while len(self.disk) > self.max_disk_runs:  # merge the two smallest (the newest ones)
            b, a = self.disk.pop(), self.disk.pop()
            self.disk.append(_merge_runs(a, b, self._tmp))
            a.close()
            b.close()
            self.disk.sort(key=lambda r: -r.n)

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        mask = np.uint64(self.bloom_bits - 1)  # bloom_bits is a power of two
        low, high = keys & np.uint64(0xFFFFFFFF), (keys >> np.uint64(32)) | np.uint64(1)
        return np.concatenate([(low + np.uint64(i) * high) & mask for i in range(3)])

    def _maybe(self, keys: np.ndarray) -> np.ndarray:
        positions = self._positions(keys).reshape(3, len(keys))
        bits = (self.bloom[positions >> 3] >> (positions & 7).astype(np.uint8)) & 1
        return bits.all(axis=0)
