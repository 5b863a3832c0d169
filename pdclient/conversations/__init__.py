"""Conversation-aware disaggregation, pure: the memory, the estimate and the decision, and
the answer the caller received."""

from ._memory import (
    SHAPE_FIELDS,
    Answer,
    AnswerCollector,
    ConversationMemory,
    ConversationSettings,
    Decision,
    Estimate,
    Match,
    Reason,
    adds_media,
    decide_remote_prefill,
    rendered_chars,
)

__all__ = [
    "Answer",
    "AnswerCollector",
    "ConversationMemory",
    "ConversationSettings",
    "Decision",
    "Estimate",
    "Match",
    "Reason",
    "SHAPE_FIELDS",
    "adds_media",
    "decide_remote_prefill",
    "rendered_chars",
]
