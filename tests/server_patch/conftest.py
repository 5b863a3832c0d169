"""Fixtures for the server_patch tier: real vLLM renderer code, real SmolLM2 tokenizer.

Run through run.py, which starts pytest under the server venv's Python once per vLLM
version, with that version's source first on PYTHONPATH and these variables set:
PDCLIENT_TEST_VLLM (the version expected), PDCLIENT_TEST_MODEL_DIR (SmolLM2 folder).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Collected from the dev venv by accident (no vLLM there): skip the whole directory.
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_version() -> str:
    import vllm

    expected = os.environ.get("PDCLIENT_TEST_VLLM")
    # Guards against the unpacked source silently not being first on sys.path.
    assert expected is None or vllm.__version__.startswith(expected), (vllm.__version__, expected)
    return vllm.__version__


@pytest.fixture(scope="session")
def model_dir() -> str:
    path = os.environ.get("PDCLIENT_TEST_MODEL_DIR")
    if not path:
        pytest.skip("PDCLIENT_TEST_MODEL_DIR unset: run through tests/server_patch/run.py")
    return path


def build_chat_renderer(model_dir: str, max_model_len: int = 2048) -> Any:
    """vLLM's own chat renderer object for this version, as its API server builds it."""
    import pdclient_server_patch as plugin
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    engine_args = EngineArgs(model=model_dir, max_model_len=max_model_len, dtype="bfloat16", enforce_eager=True)
    model_config = engine_args.create_model_config()
    renderer = renderer_from_config(VllmConfig(model_config=model_config))
    seam = plugin._find_chat_seam()
    assert seam is not None, "no chat renderer class found in this vLLM"
    cls = seam[1]
    kwargs: dict[str, Any] = dict(request_logger=None, chat_template=None, chat_template_content_format="auto")
    if cls.__name__ == "OpenAIServingRender":  # 0.20: also takes the model registry
        kwargs["model_registry"] = None
    return cls(model_config, renderer, **kwargs)


@pytest.fixture(scope="session")
def plugin(vllm_version: str) -> Any:
    import pdclient_server_patch as plugin

    plugin.register()
    return plugin


@pytest.fixture(scope="session")
def chat(model_dir: str, plugin: Any) -> Any:
    return build_chat_renderer(model_dir)


@pytest.fixture
def plugin_log(caplog: Any) -> Iterator[Any]:
    """caplog for the plugin's logger (vLLM's loggers do not propagate to the root logger)."""
    logger = logging.getLogger("vllm.plugins.pdclient_reuse")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
