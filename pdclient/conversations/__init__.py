"""Conversation-aware disaggregation, pure: the settings, the memory (of digests, ``_digests``),
the estimate and the decision, and the answer the caller received."""

from ._answer import Answer, AnswerCollector
from ._decision import CACHE_SOURCES, Decision, Estimate, Match, Reason, decide_remote_prefill
from ._digests import SHAPE_FIELDS, adds_media, rendered_chars
from ._memory import ConversationMemory, HeldTokens
from ._settings import ConversationSettings

__all__ = [
    "CACHE_SOURCES",
    "Answer",
    "AnswerCollector",
    "ConversationMemory",
    "ConversationSettings",
    "Decision",
    "Estimate",
    "HeldTokens",
    "Match",
    "Reason",
    "SHAPE_FIELDS",
    "adds_media",
    "decide_remote_prefill",
    "rendered_chars",
]
