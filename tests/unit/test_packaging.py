"""What an installed pdclient carries: one version everywhere, the server patch, the license."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pdclient

REPO = Path(__file__).resolve().parents[2]


def test_metadata_version_is_the_package_version() -> None:
    assert importlib.metadata.version("pdclient") == pdclient.__version__


def test_cli_prints_the_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdclient", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"pdclient {pdclient.__version__}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: pip builds in the source tree, and the checkout gets no build output.
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check", source, "-w", out],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("pdclient-*.whl")
    return built


def test_wheel_carries_the_server_patch_and_local_finds_it(wheel: Path, tmp_path: Path) -> None:
    """Installed from a wheel there is no checkout: LocalPD must still install its plugin."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        names = archive.namelist()
    assert f"pdclient-{pdclient.__version__}.dist-info/licenses/LICENSE" in names
    probe = "from pdclient.local._prepare import server_patch_dir; print(server_patch_dir())"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = Path(done.stdout.strip())
    assert found == site / "pdclient" / "local" / "_server_patch"
    assert (found / "pdclient_server_patch" / "__init__.py").is_file()
    assert (found / "pyproject.toml").is_file()
