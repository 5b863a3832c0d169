"""On a real LocalPD pair: the patched prefill returns the prompt's ids for Responses and Messages.

    flock /tmp/pdclient-vllm.lock python tools/check_prompt_ids_pair.py [--unpatched]

For /v1/responses and /v1/messages, streamed and not, a prefill leg whose
``kv_transfer_params`` ask for ``return_prompt_token_ids`` must answer them in its
``kv_transfer_params``, equal to the server's own chat-template render of the same
conversation (``POST /tokenize`` with the messages); a decode leg given them must answer
what a decode leg without them answers, and what the decode server alone answers. Prints
one line per check and exits 1 if any fails. Starts its own pair (~1-2 min here): the
server patch from this checkout is (re)installed into the server env first.

``--unpatched``: the same pair with vLLM told to load no plugin (``VLLM_PLUGINS``), as a
server without the patch: the flag must be accepted, the answers carry no ids, and the
handoff (without ids) must still answer as the decode server alone.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx

from pdclient.local import LocalPD

SYSTEM = "You are a terse assistant."
USER = "Name three primary colors."
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "return_prompt_token_ids": True}


def responses_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "instructions": SYSTEM, "input": USER, "max_output_tokens": max_tokens, "temperature": 0}


def messages_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": USER}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def text_of(path: str, answer: dict[str, Any]) -> str:
    if path == "/v1/responses":
        return "".join(p["text"] for item in answer["output"] for p in item.get("content") or [] if "text" in p)
    return "".join(block.get("text", "") for block in answer["content"])


def last_event_data(stream_text: str) -> list[dict[str, Any]]:
    events = []
    for line in stream_text.splitlines():
        if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]"):
            events.append(json.loads(line[6:]))
    return events


def main() -> int:
    unpatched = "--unpatched" in sys.argv[1:]
    failures = 0

    def check(what: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)

    env = {"VLLM_PLUGINS": "no-such-plugin"} if unpatched else None  # an allowlist naming none
    with LocalPD(server_env=env) as pd, httpx.Client(timeout=300) as http:
        prefill, decode = pd.prefill_url.removesuffix("/v1"), pd.decode_url.removesuffix("/v1")
        conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        tokenized = http.post(
            f"{prefill}/tokenize", json={"model": pd.model, "messages": conversation, "add_generation_prompt": True}
        ).json()["tokens"]
        print(f"server's own render of the conversation: {len(tokenized)} tokens")
        for path, make in (("/v1/responses", responses_body), ("/v1/messages", messages_body)):
            leg = {**make(pd.model, 1), "kv_transfer_params": PREFILL_KV}
            if path == "/v1/responses":
                leg["store"] = False
            answer = http.post(f"{prefill}{path}", json=leg).json()
            kv = answer.get("kv_transfer_params") or {}
            if unpatched:
                check(
                    f"{path} unpatched prefill accepts the flag, answers no ids",
                    "prompt_token_ids" not in kv and bool(kv),
                    f"keys {sorted(kv)}",
                )
                kv["prompt_token_ids"] = tokenized  # what a router would have forwarded, had it got them
            else:
                check(
                    f"{path} prefill returns prompt_token_ids",
                    kv.get("prompt_token_ids") == tokenized,
                    f"{len(kv.get('prompt_token_ids') or [])} ids, keys {sorted(kv)}",
                )
            caller = make(pd.model, 16)
            with_ids = http.post(f"{decode}{path}", json={**caller, "kv_transfer_params": kv}).json()
            # A second prefill for the decode without ids: each handoff's KV is read once.
            kv2 = http.post(f"{prefill}{path}", json=leg).json()["kv_transfer_params"]
            kv2.pop("prompt_token_ids", None)
            without_ids = http.post(f"{decode}{path}", json={**caller, "kv_transfer_params": kv2}).json()
            alone = http.post(f"{decode}{path}", json=caller).json()
            texts = [text_of(path, a) for a in (with_ids, without_ids, alone)]
            check(
                f"{path} decode with forwarded ids answers as without and as alone",
                len(set(texts)) == 1,
                repr(texts[0]) if len(set(texts)) == 1 else repr(texts),
            )
            # Streamed prefill leg: where vLLM puts kv_transfer_params in the stream.
            streamed = http.post(f"{prefill}{path}", json={**leg, "stream": True}).text
            events = last_event_data(streamed)
            if path == "/v1/responses":
                final = [e for e in events if e.get("type") == "response.completed"]
                ids = final[-1]["response"].get("kv_transfer_params", {}).get("prompt_token_ids") if final else None
                check(
                    f"{path} stream: response.completed carries them",
                    ids == (None if unpatched else tokenized),
                    f"{len(ids or [])} ids in response.completed.response.kv_transfer_params",
                )
                # This streamed prefill's KV is never read: release it as a router would.
                if final and final[-1]["response"].get("kv_transfer_params"):
                    release = {
                        **caller,
                        "max_output_tokens": 1,
                        "kv_transfer_params": final[-1]["response"]["kv_transfer_params"],
                    }
                    http.post(f"{decode}{path}", json=release)
            else:
                carried = [e for e in events if "kv_transfer_params" in json.dumps(e)]
                print(f"info {path} stream: {len(events)} events, {len(carried)} carry kv_transfer_params")
    print("all ok" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
