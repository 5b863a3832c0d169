"""Whether a call's decode stream may move, decided when its decode body is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import wire
from ._call_migration import CallMigration, request_field

if TYPE_CHECKING:
    from ._call import MigratingCall as Call

# vLLM's guided-decoding fields: with any of them set, a continuation's decoding would
# restart at the schema's root.
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def static_refusal(plan: wire.Plan) -> str | None:
    """Why no continuation of this request could be exact, from the request alone; None if one can."""
    fields = plan.fields
    if not plan.stream and request_field(fields, "stream_options") is not None:
        # vLLM refuses stream_options on a non-streamed call: the caller gets that 400 as before.
        return "stream_options on a non-streamed call"
    if plan.ids_skipped is not None:
        return f"the prompt's ids are not forwarded ({plan.ids_skipped})"
    n = request_field(fields, "n")
    if n not in (None, 1):
        return "n > 1 (one continuation per choice is not supported)"
    best_of = request_field(fields, "best_of")
    if best_of not in (None, 1):
        return "best_of > 1"
    if request_field(fields, "stop"):
        return "stop strings (one may span the cut, and vLLM holds back the text that could start one)"
    tools = request_field(fields, "tools")
    if tools and request_field(fields, "tool_choice") != "none":
        return "tools offered (a tool call cannot be continued, and the tool parser holds back text)"
    response_format = request_field(fields, "response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured output (guided decoding would restart at the schema's root)"
    if any(request_field(fields, name) is not None for name in _GUIDED_FIELDS):
        return "structured output (guided decoding would restart at the schema's root)"
    for name in ("presence_penalty", "frequency_penalty"):
        if request_field(fields, name) not in (None, 0, 0.0):
            return f"{name} (vLLM counts it over generated tokens only; they would become prompt)"
    if request_field(fields, "bad_words"):
        return "bad_words (a banned sequence may span the cut)"
    if request_field(fields, "prompt_logprobs") is not None:
        return "prompt_logprobs"
    if plan.kind is wire.Kind.COMPLETIONS and request_field(fields, "logprobs") is not None:
        return "completions logprobs (their text offsets restart at the cut)"
    if request_field(fields, "seed") is not None and request_field(fields, "temperature") not in (0, 0.0):
        return "a seeded sample (a continuation cannot replay the seed's random stream)"
    if request_field(fields, "truncate_prompt_tokens") is not None:
        return "truncate_prompt_tokens (would cut the continuation's prompt)"
    if request_field(fields, "logits_processors"):
        return "custom logits processors"
    return None


def arm(call: Call, *, tracked: bool = False) -> CallMigration:
    """Whether this call's decode stream may move, decided when its decode body is built;
    ``tracked``: its stream is tracked even if it may not (its prompt ids are wanted)."""
    assert call.plan is not None
    plan, options = call.plan, call.context.options
    limit = call.effective.max_decode_migrations
    prompt_ids: bytes | None = None
    prompt_count = 0
    result = call.prefill_result
    if result is not None and result.ids is not None:
        prompt_ids, prompt_count = result.ids, result.count
    reason: str | None
    if limit == 0:
        reason = "max_decode_migrations is 0"
    elif not plan.stream and not options.migrate_non_streamed:
        # Its decode leg would have to stream, which costs the decode server's API process
        # more CPU on every call; off, the openai SDK's max_retries repeats a failed one whole.
        reason = "not streamed (migrate_non_streamed is off)"
    elif len(call.context.fleet.decode.endpoints) < 2:
        reason = "no other decode endpoint (decode_base_url lists one)"
    elif call.fallback_url is not None:
        reason = "sent to the fallback server"
    else:
        reason = static_refusal(plan)
    return CallMigration(plan, limit, reason, prompt_ids, prompt_count, tracked=tracked)
