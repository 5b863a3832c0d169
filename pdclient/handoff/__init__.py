"""One call: ``Call`` (plan, phase, legs, outcome, trace) and ``Leg``; what the call decides
with (the remote prefill and its conversation, the legs' requests, what goes back to the
caller); a broken stream's move as steps (``move``); ``dispatch``: both legs at once; the
KV release."""

from . import _dispatch as dispatch
from ._call import Call, CallContext, Phase
from ._failure import PREFILL_FAILURES, PrefillRedirected
from ._leg import Leg
from ._leg_requests import (
    LegRequests,
    asks_usage,
    decode_body,
    leg_url,
    new_correlation_id,
    new_leg_id,
    request_with_content,
)
from ._move import STREAM_ERRORS, Move, OpenDecode, ReadRefusal, Release, SendPrefill, Step, move
from ._release import RELEASE_TIMEOUT, release_leg, release_request
from ._remote_prefill import (
    ConversationTurn,
    HandoffInstead,
    RemotePrefill,
    conversation_home,
    handoff_after_all,
    remote_prefill_decision,
)
from ._report import CALL_RECORD, STORED_STATE
from ._to_caller import CallerBody, id_tags_for, usage_merge_for

__all__ = [
    "PREFILL_FAILURES",
    "PrefillRedirected",
    "CALL_RECORD",
    "RELEASE_TIMEOUT",
    "STORED_STATE",
    "STREAM_ERRORS",
    "Call",
    "CallContext",
    "CallerBody",
    "ConversationTurn",
    "HandoffInstead",
    "Leg",
    "LegRequests",
    "Move",
    "OpenDecode",
    "Phase",
    "RemotePrefill",
    "ReadRefusal",
    "Release",
    "SendPrefill",
    "Step",
    "asks_usage",
    "conversation_home",
    "decode_body",
    "dispatch",
    "handoff_after_all",
    "id_tags_for",
    "leg_url",
    "move",
    "new_correlation_id",
    "new_leg_id",
    "release_leg",
    "release_request",
    "remote_prefill_decision",
    "request_with_content",
    "usage_merge_for",
]
