"""LocalPD's server env gets the server patch of the checkout it runs from, reinstalled when it changes.

The server env is cached across runs (its key is vLLM's and NIXL's pins, not the patch), so
the patch has its own key: a digest of its source tree, stamped in the env after each
install. A machine that already has the env, then a changed patch (an edited module, a new
one), must reinstall it, or a test run would exercise a stale patch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdclient.local import _prepare


@pytest.fixture
def installs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    source = tmp_path / "server_patch"
    shutil.copytree(_prepare.REPO_ROOT / "server_patch", source, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(_prepare, "server_patch_dir", lambda: source)
    calls: list[list[str]] = []
    monkeypatch.setattr(_prepare, "_run", lambda cmd, step, log: calls.append(cmd))
    return calls


def install(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    _prepare._install_server_patch(venv / "bin" / "python", venv, tmp_path / "log")


def test_installed_once_then_again_only_when_the_patch_changes(tmp_path: Path, installs: list[list[str]]) -> None:
    install(tmp_path)
    assert len(installs) == 1 and "--force-reinstall" in installs[0]
    install(tmp_path)
    assert len(installs) == 1  # unchanged: the stamp matches
    package = tmp_path / "server_patch" / "pdclient_server_patch"
    (package / "_new_part.py").write_text("X = 1\n")  # a new module
    install(tmp_path)
    assert len(installs) == 2
    init = package / "__init__.py"
    init.write_text(init.read_text() + "\n# edited\n")  # an edited one
    install(tmp_path)
    assert len(installs) == 3


def test_bytecode_caches_do_not_count_as_a_change(tmp_path: Path, installs: list[list[str]]) -> None:
    install(tmp_path)
    cache = tmp_path / "server_patch" / "pdclient_server_patch" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "x.cpython-311.pyc").write_bytes(b"\0")
    install(tmp_path)
    assert len(installs) == 1
