"""One call: ``Call`` (plan, phase, legs, outcome, trace) and ``Leg``; a broken stream's move as
steps (``move``); ``dispatch``: both legs at once."""

from . import _dispatch as dispatch
from ._call import CALL_RECORD, Call, CallContext, HandoffInstead, Leg, leg_url, new_request_id, request_with_content
from ._move import STREAM_ERRORS, Move, OpenDecode, ReadRefusal, Release, SendPrefill, Step, move

__all__ = [
    "STREAM_ERRORS",
    "Move",
    "OpenDecode",
    "ReadRefusal",
    "Release",
    "SendPrefill",
    "Step",
    "move",
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
