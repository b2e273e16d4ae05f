"""A GGUF shipped as ordered parts in several data-only packages (issue 48): joined once into the cache,
every part checked against its wheel's RECORD hash, the whole against the expected sha256; a missing or
corrupt part fails before anything loads, naming the part and the hash."""
from __future__ import annotations

import base64
import hashlib
import os

import pytest
from gguf_helpers import write_tiny_gguf

from batchrl.training.models.gguf_parts import join_parts, joined_path, resolve_parts
from batchrl.training.models.gguf import GgufSourceError, cached_hf_from_gguf


def _install_part(site, dist: str, rel: str, data: bytes) -> str:
    """A data-only distribution as pip leaves it: the file plus a dist-info whose RECORD hashes it."""
    target = site / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    info = site / f"{dist.replace('-', '_')}-0.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.9.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"{rel},sha256={digest},{len(data)}\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return f"{dist}:{rel}"


@pytest.fixture()
def parts(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(gguf))
    data = gguf.read_bytes()
    site = tmp_path / "site"
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    specs = [_install_part(site, f"tiny-model-part{i + 1}", f"tiny_model_part{i + 1}/data/part0{i + 1}.bin",
                           data[cut[i]:cut[i + 1]]) for i in range(3)]
    monkeypatch.syspath_prepend(str(site))
    return {"specs": specs, "sha256": hashlib.sha256(data).hexdigest(), "site": site, "bytes": len(data)}


def test_joined_once_verified_and_converted(parts, tmp_path):
    path, provenance = join_parts(parts["specs"], parts["sha256"], str(tmp_path / "cache"))
    assert path == joined_path(str(tmp_path / "cache"), parts["sha256"]) and os.path.getsize(path) == parts["bytes"]
    assert [p["package"] for p in provenance["parts"]] == ["tiny-model-part1", "tiny-model-part2", "tiny-model-part3"]
    assert all(p["package_version"] == "0.9.0" and len(p["sha256"]) == 64 for p in provenance["parts"])
    mtime = os.path.getmtime(path)
    again, _ = join_parts(parts["specs"], parts["sha256"].upper(), str(tmp_path / "cache"))
    assert again == path and os.path.getmtime(path) == mtime  # content-addressed: joined once
    folder, info = cached_hf_from_gguf(path, str(tmp_path / "cache"))
    assert info["gguf_sha256"] == parts["sha256"] and os.path.isfile(os.path.join(folder, "config.json"))


def test_a_corrupt_part_is_named_with_the_hash_its_package_records(parts, tmp_path):
    victim = parts["site"] / "tiny_model_part2/data/part02.bin"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(GgufSourceError, match=r"GGUF part 2 .*tiny-model-part2.* is corrupt: .*records [0-9a-f]{64}"):
        join_parts(parts["specs"], parts["sha256"], str(tmp_path / "cache"))
    assert not os.listdir(tmp_path / "cache" / "gguf-parts")  # no half-joined file left behind


def test_wrong_order_or_wrong_hash_names_the_expected_hash(parts, tmp_path):
    wrong = [parts["specs"][1], parts["specs"][0], parts["specs"][2]]
    with pytest.raises(GgufSourceError, match=f"expected {parts['sha256']}: a part is wrong, missing or out of order"):
        join_parts(wrong, parts["sha256"], str(tmp_path / "cache"))
    with pytest.raises(GgufSourceError, match="64-hex-digit sha256"):
        join_parts(parts["specs"], "abc", str(tmp_path / "cache"))


def test_a_missing_part_fails_before_anything_is_read(parts):
    with pytest.raises(GgufSourceError, match=r"part 4 of 4 \('tiny-model-part4:.*'\) is missing: .*not installed"):
        resolve_parts(parts["specs"] + ["tiny-model-part4:tiny_model_part4/data/part04.bin"])
    with pytest.raises(GgufSourceError, match=r"part 2 of 3 .* is missing: .*is not a file of distribution"):
        resolve_parts([parts["specs"][0], "tiny-model-part2:elsewhere.bin", parts["specs"][2]])


def test_batchrl_run_names_a_missing_part_before_anything_runs(tmp_path):
    """The up-front check of a run that builds the base model (exit 2, one line naming the part); a run that does not
    build it needs no parts."""
    import subprocess
    import sys

    config = tmp_path / "c.yaml"
    config.write_text("ops:\n  base_model:\n    config:\n      gguf_parts: ['no-such-part-pkg:x/part01.bin']\n"
                      f"      gguf_sha256: '{'a' * 64}'\n")
    env = {**os.environ, "BATCHRL_STORAGE": str(tmp_path / "s"), "DAGSTER_HOME": str(tmp_path / "home")}
    cli = [sys.executable, "-m", "batchrl.cli", "run", "-c", str(config)]
    built = subprocess.run([*cli, "--select", "base_model"], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 2, built.stderr
    assert "gguf_parts: GGUF part 1 of 1 ('no-such-part-pkg:x/part01.bin') is missing" in built.stderr
    assert not (tmp_path / "s" / "base_model").exists()


class _CountedReads:
    """A real file whose ``read`` calls count the bytes they return (the hash reads a file whole with ``read``;
    the conversion maps it)."""

    def __init__(self, file, counts: dict, path: str) -> None:
        self._file, self._counts, self._path = file, counts, path

    def read(self, *args):
        block = self._file.read(*args)
        self._counts[self._path] = self._counts.get(self._path, 0) + len(block)
        return block

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def test_the_joined_gguf_is_hashed_once_and_a_changed_cache_still_fails(parts, tmp_path, monkeypatch):
    """The join's hash goes through to the conversion (1.1 GB read once, not twice); a joined file that changed
    since, as a later run sees it, is hashed there again and refused against the expected sha256."""
    import builtins

    import dagster as dg

    from batchrl.assets.models import _from_gguf_parts
    from batchrl.resources import StorageResource

    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))
    joined = joined_path(storage.cache_dir, parts["sha256"])
    counts: dict[str, int] = {}
    real_open = builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        path = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else None
        return _CountedReads(opened, counts, path) if path == joined and "b" in mode else opened

    monkeypatch.setattr(builtins, "open", counting_open)
    info, _ = _from_gguf_parts(parts["specs"], parts["sha256"], storage, str(tmp_path / "staging1"))
    assert info["gguf_sha256"] == parts["sha256"] and os.path.isfile(tmp_path / "staging1" / "config.json")
    assert counts.get(joined, 0) < 64  # the magic bytes only: the joined file was not hashed a second time
    cached = next(f for f in os.listdir(tmp_path / "staging1") if f.endswith(".safetensors"))
    converted = os.path.dirname(next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cache" / "gguf")
                                     for f in fs if f == cached))
    # the base model's weights are the cache's bytes, linked: one copy on disk, not two (7.1 GB each at 1.5B)
    assert os.path.samefile(tmp_path / "staging1" / cached, os.path.join(converted, cached))

    later = os.stat(joined).st_mtime_ns + 10**9  # the same bytes as a later run finds them: hashed there, once
    os.utime(joined, ns=(later, later))
    counts.clear()
    info, _ = _from_gguf_parts(parts["specs"], parts["sha256"], storage, str(tmp_path / "staging2"))
    assert info["gguf_sha256"] == parts["sha256"] and parts["bytes"] <= counts[joined] < parts["bytes"] + 64

    data = bytearray(open(joined, "rb").read())
    data[len(data) // 2] ^= 0xFF  # the cached join corrupted in place, same size
    with real_open(joined, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(dg.Failure, match=f"base_model.gguf_parts: .* expected {parts['sha256']}: the cached file "
                                         "changed after it was verified"):
        _from_gguf_parts(parts["specs"], parts["sha256"], storage, str(tmp_path / "staging3"))
