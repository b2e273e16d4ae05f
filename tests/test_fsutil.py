"""fsutil.link_tree: a trained model's export enters the storage root as hard links, copied only across
filesystems."""
import os
import tempfile

import pytest

from batchrl.common.fsutil import link_tree


def _tree(root) -> None:
    os.makedirs(root / "sub")
    (root / "model.safetensors").write_bytes(b"\x00weights" * 1000)
    (root / "sub" / "tokenizer.json").write_text("{}")


def test_same_filesystem_links_every_file(tmp_path):
    _tree(tmp_path / "src")
    link_tree(str(tmp_path / "src"), str(tmp_path / "dst"))
    for rel in ("model.safetensors", os.path.join("sub", "tokenizer.json")):
        a, b = tmp_path / "src" / rel, tmp_path / "dst" / rel
        assert os.stat(a).st_ino == os.stat(b).st_ino and a.read_bytes() == b.read_bytes()
    os.remove(tmp_path / "dst" / "model.safetensors")  # removing one name keeps the other's bytes
    assert (tmp_path / "src" / "model.safetensors").read_bytes() == b"\x00weights" * 1000


def test_another_filesystem_is_copied(tmp_path):
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem (/dev/shm) on this machine")
    _tree(tmp_path / "src")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        link_tree(str(tmp_path / "src"), os.path.join(other, "dst"))
        copied = os.path.join(other, "dst", "model.safetensors")
        assert os.stat(copied).st_ino != os.stat(tmp_path / "src" / "model.safetensors").st_ino
        assert open(copied, "rb").read() == (tmp_path / "src" / "model.safetensors").read_bytes()
        assert open(os.path.join(other, "dst", "sub", "tokenizer.json")).read() == "{}"


def test_without_copies_another_filesystem_raises(tmp_path):
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem (/dev/shm) on this machine")
    _tree(tmp_path / "src")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        with pytest.raises(OSError):
            link_tree(str(tmp_path / "src"), os.path.join(other, "dst"), copy=False)
