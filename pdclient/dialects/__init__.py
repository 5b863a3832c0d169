"""The APIs a P/D call may speak, one dialect each, on bytes and without I/O: chat
completions, completions, Responses, Messages. A dialect says how the API's bodies look
for each leg, where its prefill's ids, KV parameters and usage live, and whether its
decode stream may move; the handoff asks the dialect and never branches on the API."""

from ._dialect import Dialect
from ._registry import DIALECTS, dialect_for, dialect_of

__all__ = ["DIALECTS", "Dialect", "dialect_for", "dialect_of"]
