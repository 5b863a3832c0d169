"""Token-exact decode migration: a decode stream cut mid-answer continues elsewhere.

The decisions and the bytes, no I/O (the streams that send the continuation are in
``handoff._decode_body.MovingBody``). One ``CallMigration`` per P/D call, made when its decode body is built:

- **arming** (``_arming.arm``): a call can move only if its prompt ids are known, the pool
  has another decode endpoint, ``max_decode_migrations`` > 0, and nothing in the request
  makes a continuation inexact (``static_refusal``). An unarmed call goes as before (no
  token ids asked for, no event parsed) and the reason goes into the error if its stream breaks.
- **non-streamed calls** (``_assembler.Assembler``, ``PDOptions.migrate_non_streamed``, off
  by default): an armed call that did not ask for a stream streams its decode leg all the
  same (``stream: true``, ``stream_options.include_usage``), so that it can move like any
  other, and the caller gets the JSON body vLLM would have answered, assembled from the events.
- **tracking** (``_tracker.Tracker``): an armed call's decode leg carries
  ``return_token_ids: true``; vLLM then puts each chunk's generated ids in
  ``choices[0].token_ids`` (and the prompt's in the first chunk). The tracker splits the SSE
  body into events, keeps the ids of every chunk it passed on, and strips ``token_ids`` /
  ``prompt_token_ids`` (unless the caller asked for them) by cutting them out of the event's
  bytes. A chunk that carries ids but no text (a character split across tokens, a special
  token) is held back until the next chunk with text, so at any moment the ids kept are
  exactly those whose text the caller has: a cut drops the held chunks and the new server
  generates those tokens again.
- **continuing** (``_continuation.Continuation``, made by ``CallMigration.begin`` in
  ``_call_migration``): the prompt ids plus the kept ids become the prompt
  (``kv_transfer_params.prompt_token_ids`` on chat, the id ``prompt`` on completions), with
  the caller's sampling fields and ``max_tokens`` / ``max_completion_tokens`` /
  ``min_tokens`` reduced by what was generated. ``continuation_route`` says whether the
  decode endpoint computes that prompt itself or a prefill endpoint does first.
- **splicing** (``_splice.Splice``, from ``Tracker.splice``): the continuation's events reach
  the caller under the original ``id``, ``created`` and ``model``; its role chunk is dropped;
  ``usage`` counts the original prompt and the whole answer once.
- **an ended answer** (``Tracker.answered``): once every choice has sent its
  ``finish_reason`` the answer is whole; a cut after that never moves (a continuation
  would append a second answer). The stream is ended as vLLM ends one: the usage event if
  the caller asked for usage and had not got it, then ``[DONE]`` (``CallMigration.ending``).

Prior art: NVIDIA Dynamo replays the generated token ids to a new worker
(``--migration-limit``, ai-dynamo/dynamo#1930) and refuses guided decoding
(ai-dynamo/dynamo#7930); llm-d proposes the same for its router (llm-d/llm-d-router#2345).
See docs/ARCHITECTURE.md, "Decode migration".
"""

from ._arming import arm
from ._assembler import Assembler, CannotAssemble
from ._call import MigratingCall
from ._call_migration import CallMigration, CannotMove
from ._continuation import Continuation, Route
from ._tracker import Tracker

__all__ = [
    "Assembler",
    "CallMigration",
    "CannotAssemble",
    "CannotMove",
    "Continuation",
    "Route",
    "MigratingCall",
    "Tracker",
    "arm",
]
