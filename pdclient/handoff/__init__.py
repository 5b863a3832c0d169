"""One call: ``Call`` (plan, phase, legs, outcome, trace) and ``Leg``; ``dispatch``: both legs at once."""

from . import _dispatch as dispatch
from ._call import CALL_RECORD, Call, CallContext, HandoffInstead, Leg, leg_url, new_request_id, request_with_content

__all__ = [
    "CALL_RECORD",
    "Call",
    "CallContext",
    "HandoffInstead",
    "Leg",
    "leg_url",
    "new_request_id",
    "dispatch",
    "request_with_content",
]
