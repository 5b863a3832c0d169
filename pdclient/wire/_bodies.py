"""The wire contract of a P/D call, on bytes: pure functions, no I/O.

The caller's JSON body is read once into its top-level fields, each kept as the exact
bytes the caller sent (``msgspec.Raw``), so every field pdclient does not own reaches the
servers byte for byte (an integer beyond 64 bits stays an integer). Only the fields the
contract names are written:

- prefill leg: ``stream: false``, no ``stream_options``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1`` if present), no ``min_tokens``, ``n: 1``, no ``best_of``,
  ``return_token_ids: true``, ``kv_transfer_params: PREFILL_KV_TRANSFER_PARAMS``;
- decode leg: the caller's fields plus ``kv_transfer_params`` = the prefill's object with
  ``"prompt_token_ids": ids`` added (chat), or ``prompt`` = the ids (completions);
- ``pdclient`` (the per-call options) never reaches a server;
- no request pdclient forwards, P/D or pass-through, carries a ``kv_transfer_params``
  it did not write (``check_forwarded_body``, ``UploadScan``).

The prefill's id list is never decoded into Python ints: it is located in the response
bytes, checked to be a non-empty array of non-negative integers on the bytes, and
spliced into the decode body as it came. See docs/ARCHITECTURE.md, "The wire contract".

One module a part: the caller's body and its plan (``_plan``), what no caller may send
(``_forwarded``), the prefill leg's bodies and answer (``_prefill``); here, the decode
leg's body and the KV release's.
"""

from __future__ import annotations

import msgspec

from ._plan import Kind, Plan, encode_fields
from ._prefill import PrefillResult, one_token, with_prompt_ids


def decode_fields(plan: Plan, prefill: PrefillResult | None) -> dict[str, msgspec.Raw]:
    """The decode leg's fields: the caller's, with the prefill's handoff attached.

    The prefill's ``kv_transfer_params`` go through whole and unmodified (they belong to
    its KV connector). The ids are never extended by the prefill's sampled token: the
    decode prompt must have the prefill's length for the connector's block accounting.
    """
    fields = dict(plan.fields)
    if prefill is None:
        return fields
    ids = prefill.ids if plan.ids_skipped is None else None
    kv = prefill.kv_transfer_params
    if ids is not None and plan.kind is Kind.COMPLETIONS:
        # vLLM takes a token-id prompt on /completions natively, in every version.
        fields["prompt"] = msgspec.Raw(ids)
    elif ids is not None:
        # Chat, and the APIs vLLM renders through chat's preprocess_chat (Responses, Messages).
        kv = with_prompt_ids(kv, ids)
    if kv is not None and kv.strip() != b"{}":
        fields["kv_transfer_params"] = msgspec.Raw(kv)
    return fields


def decode_body(plan: Plan, prefill: PrefillResult | None) -> bytes:
    return encode_fields(decode_fields(plan, prefill))


def release_body(plan: Plan, prefill: PrefillResult) -> bytes:
    """A one-token decode that completes an abandoned handoff.

    The prefill server keeps a request's KV blocks until a decode pulls them (or until
    the connector's timeout, minutes later). When the caller goes away between the two
    legs, this minimal decode pulls them so the prefill server frees them at once.
    """
    return encode_fields(one_token(decode_fields(plan, prefill)))
