"""The dialects by route: which API a POST under the decode base URL speaks, if any."""

from __future__ import annotations

from ._chat import CHAT, COMPLETIONS
from ._dialect import Dialect
from ._messages import MESSAGES
from ._responses import RESPONSES

DIALECTS: tuple[Dialect, ...] = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
_BY_PATH: dict[str, Dialect] = {d.path: d for d in DIALECTS}


def dialect_for(relative_path: str) -> Dialect | None:
    """The dialect of a POST to this path under the API's base URL, or None (a pass-through:
    ``/messages/count_tokens``, ``/responses/{id}``, models, embeddings, ...)."""
    return _BY_PATH.get(relative_path.rstrip("/"))
