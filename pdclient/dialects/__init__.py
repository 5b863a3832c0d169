"""The APIs a P/D call may speak, one dialect each, on bytes and without I/O: chat
completions, completions, Responses, Messages. A dialect says how the API's bodies look
for each leg, where its prefill's ids, KV parameters and usage live, and whether its
decode stream may move; the handoff asks the dialect and never branches on the API.
A stored response's decode endpoint travels as a tag in its id (``_stored_state``)."""

from ._dialect import Dialect
from ._registry import DIALECTS, dialect_for
from ._stored_state import (
    MAX_ID_LENGTH,
    IdTags,
    endpoint_for,
    endpoint_tag,
    names_a_response,
    tag_event,
    tag_id,
    tag_json,
    untag_id,
    untag_path,
)

__all__ = [
    "DIALECTS",
    "MAX_ID_LENGTH",
    "Dialect",
    "IdTags",
    "dialect_for",
    "endpoint_for",
    "endpoint_tag",
    "names_a_response",
    "tag_event",
    "tag_id",
    "tag_json",
    "untag_id",
    "untag_path",
]
