"""`pip wheel .` holds batchrl's code and the files it reads at run time (profiles, sample data) under `batchrl/`,
and not tests/, bench/, docs/ or scripts/; installed from the wheel, batchrl finds its profiles and sample data.

pyproject lists the packages one by one (setuptools' package finder would install `assets`, `training`, ...
as top-level names): a new package folder missing from that list fails here."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_SHIPPED = ("tests/", "bench/", "docs/", "scripts/", ".ci/")


def _source_files() -> list[str]:
    """The checkout's files as a clone would have them (tracked or new, not ignored: no .venv, storage, caches)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [path for path in listed if os.path.isfile(os.path.join(REPO, path))]


def _shipped(path: str) -> bool:
    """A file the package needs: its modules, the profiles and the sample data."""
    if path.startswith("sample_data/") or (path.startswith("profiles/") and path.endswith(".yaml")):
        return True
    return path.endswith(".py") and not path.startswith(NOT_SHIPPED)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the wheel's path, the source files) built from a copy of the checkout: an in-place build would leave
    build/ behind, and files a removed module left there would end up in the next wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = _source_files()
    for path in files:
        os.makedirs(os.path.dirname(tmp / "src" / path), exist_ok=True)
        shutil.copy2(os.path.join(REPO, path), tmp / "src" / path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(tmp / "src")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("batchrl-*.whl")
    return wheel, files


def test_wheel_holds_the_code_profiles_and_sample_data_only(built):
    wheel, files = built
    names = {n for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(".dist-info")}
    expected = {f"batchrl/{path}" for path in files if _shipped(path)}
    assert expected - names == set(), "missing from the wheel (pyproject's packages / package-data)"
    assert names - expected == set(), "in the wheel but not a module, profile or sample-data file"
    assert any(n.startswith("batchrl/sample_data/arith/") for n in names) and "batchrl/profiles/real.yaml" in names


def test_installed_wheel_finds_its_profiles_and_sample_data(built, tmp_path):
    wheel, _ = built
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("from batchrl.resources import profiles; import os; "
             "print(profiles.PROFILE_DIR); print(','.join(profiles.available_profiles())); "
             "print(sorted(os.listdir(profiles.SAMPLE_DATA)))")
    # PYTHONPATH comes before the editable install of the checkout: this imports the wheel's copy
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout.splitlines()
    assert out[0] == str(target / "batchrl" / "profiles")
    assert "real" in out[1].split(",")
    assert "arith" in out[2]
