"""One rule for which content parts are text, held against one table of cases on both sides:
the client's (``pdclient.wire.is_text_part``) and the server patch's (``has_media`` in
``pdclient_server_patch/_reuse.py``, which imports nothing of pdclient)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pdclient.conversations import adds_media
from pdclient.wire import has_media, is_text_part

SERVER_REUSE = Path(__file__).parents[2] / "server_patch" / "pdclient_server_patch" / "_reuse.py"

# (part, vLLM renders it as text)
CASES: list[tuple[Any, bool]] = [
    ("a plain string part", True),
    ({"type": "text", "text": "hi"}, True),
    ({"type": "input_text", "text": "hi"}, True),
    ({"type": "output_text", "text": "hi"}, True),
    ({"type": "refusal", "refusal": "no"}, True),
    ({"type": "thinking", "thinking": "hmm"}, True),
    ({"type": "tool_reference", "tool_name": "search"}, True),
    ({"text": "a part without a type reads as text"}, True),
    ({"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, False),
    ({"type": "input_image", "image_url": "http://x/cat.png"}, False),
    ({"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}}, False),
    ({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}, False),
    ({"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}}, False),
    ({"type": "file", "file": {"file_id": "f"}}, False),
    ({"type": "image_embeds", "image_embeds": "..."}, False),
    ({"type": "reasoning", "text": "not a type vLLM renders as text"}, False),
    ({"type": "text", "text": "a text type", "image_url": {"url": "http://x"}}, False),  # a media key wins
    ({"image_url": {"url": "http://x/cat.png"}}, False),  # no type, a media key
]


def server_has_media() -> Any:
    spec = importlib.util.spec_from_file_location("server_reuse", SERVER_REUSE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.has_media


@pytest.mark.parametrize(("part", "text"), CASES, ids=[repr(p)[:40] for p, _ in CASES])
def test_client_and_server_patch_agree_on_every_case(part: Any, text: bool) -> None:
    messages = [{"role": "user", "content": [part]}]
    assert is_text_part(part) is text
    assert has_media(messages) is not text
    assert adds_media(messages) is not text
    assert server_has_media()(messages) is not text


def test_plain_string_content_and_odd_shapes() -> None:
    assert not has_media([{"role": "user", "content": "hi"}])
    assert not has_media("not a list of messages")
    assert has_media([{"role": "user", "content": [7]}])  # unsure is media (vLLM refuses it anyway)
