"""The one build step pyproject.toml cannot say: the wheel carries the server patch.

``pdclient.local`` installs the vLLM plugin in ``server_patch/`` into the server
environment it prepares. From a checkout it reads that folder; from an installed wheel
there is no checkout, so the wheel carries a copy of the plugin's source as
``pdclient/local/_server_patch/`` (package data, never imported by pdclient).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SERVER_PATCH = Path(__file__).resolve().parent / "server_patch"
BUNDLED = Path("pdclient", "local", "_server_patch")


class BuildWithServerPatch(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads server_patch/ in the checkout
            return
        target = Path(self.build_lib) / BUNDLED
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(SERVER_PATCH, target, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))


setup(cmdclass={"build_py": BuildWithServerPatch})
