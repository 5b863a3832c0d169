"""The error object pdclient answers with, in the OpenAI shape both SDKs read."""

from __future__ import annotations

from typing import Any

ERROR_TYPE = "pdclient_error"
"""The ``type`` of every error pdclient itself answers (a server's own errors pass as they are)."""


def error_body(message: str, code: int) -> dict[str, Any]:
    """The ``error`` object of a JSON error answer or of a stream's error event."""
    return {"message": message, "type": ERROR_TYPE, "code": code}
