"""One call: its flow of steps (``call_flow``, run by a transport's driver), ``Call`` (plan,
phase, legs, outcome, trace) and ``Leg``; what the call decides with (the remote prefill
and its conversation, the legs' requests, what goes back to the caller); a broken stream's
move, a flow of the same steps (``move``); ``steps``: the I/O a flow asks its driver for;
``dispatch``: both legs at once; the KV release."""

from . import _dispatch as dispatch
from . import _steps as steps
from ._call import Call, CallContext, Phase
from ._decode_body import Body, MovingBody, PlainBody, body_for
from ._effective import EffectiveOptions
from ._failure import PREFILL_FAILURES, PrefillRedirected
from ._flow import call_flow, open_decode
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
from ._move import Move, move
from ._record import CallRecord
from ._release import RELEASE_TIMEOUT, release_leg, release_request
from ._remote_prefill import (
    ConversationTurn,
    RemotePrefill,
    conversation_home,
    handoff_after_all,
    remote_prefill_decision,
)
from ._report import CALL_RECORD, STORED_STATE
from ._to_caller import CallerBody, id_tags_for, usage_merge_for

__all__ = [
    "Body",
    "MovingBody",
    "PlainBody",
    "body_for",
    "call_flow",
    "open_decode",
    "PREFILL_FAILURES",
    "PrefillRedirected",
    "CALL_RECORD",
    "RELEASE_TIMEOUT",
    "STORED_STATE",
    "Call",
    "CallContext",
    "CallRecord",
    "CallerBody",
    "ConversationTurn",
    "EffectiveOptions",
    "Leg",
    "LegRequests",
    "Move",
    "Phase",
    "RemotePrefill",
    "asks_usage",
    "conversation_home",
    "decode_body",
    "dispatch",
    "steps",
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
