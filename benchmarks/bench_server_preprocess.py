"""Decode-side preprocessing: chat template + tokenize versus forwarded prompt ids.

    python benchmarks/bench_server_preprocess.py [--repeats 15] [--sizes 2048,8192,32768]

Runs vLLM's real chat renderer (``render_chat``: the step between the parsed request and
the engine) with the real SmolLM2 tokenizer, in one process per vLLM version, under the
server venv's Python:

- vLLM 0.26.0 (unpacked wheel, see tests/server_patch/_vllm_src.py) with the plugin, which
  adds the reuse path;
- vLLM 0.32.0 (installed) without the plugin: its native reuse path.

For each prompt size it times, medians over ``--repeats`` runs after warm-up:
``render``: render_chat alone; ``parse+render``: the JSON body to pydantic request plus
render_chat (a body with ids is bigger, so this is the fairer end-to-end figure). On 0.32
it also times the plugin's guard on the same body signed (spec v2: HMAC over the whole
body, no parse) and on an unsigned body without ``kv_transfer_params``, and pdclient's
``signature()`` of that body, beside the template+tokenize cost they are set against.
Prints a table of medians and ratios (template+tokenize / forwarded ids).

The same conversation is also sent as a Responses request (``input`` items) and as an
Anthropic Messages request (``system`` + ``messages``), each through that route's own
render step in vLLM (``tests/server_patch/_routes.py``: Responses' input construction or
``render_responses``, Messages' conversion to a chat request, then the chat renderer),
with and without the forwarded ids in ``kv_transfer_params``. The three routes are timed
side by side in the same loop, interleaved, so a slow phase of the machine hits them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VERSIONS = (("0.26.0", True), ("0.32.0", False))  # (vLLM, load the plugin)

PARAGRAPH = (
    "Disaggregated serving splits a request in two. The prefill server reads the whole prompt, "
    "fills the KV cache and returns the first token; the decode server pulls that cache over "
    "the network and generates the rest. Section {i}: the operator measured {n} requests per "
    "second at p99 latency of {m} ms, with tool calls, JSON output and a long system prompt. "
)


def conversation(scale: int) -> list[dict[str, str]]:
    """A multi-turn chat that grows with ``scale`` (about 75 tokens per unit)."""
    messages = [{"role": "system", "content": "You are a careful assistant. Answer from the documents."}]
    for turn in range(8):
        text = "".join(PARAGRAPH.format(i=turn * 1000 + k, n=37 + k, m=120 + 3 * k) for k in range(scale // 8 + 1))
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
    messages.append({"role": "user", "content": "Summarise the documents above in one sentence."})
    return messages


def child(version: str, with_plugin: bool, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Measure in this process (server venv, the right vLLM first on sys.path)."""
    import asyncio

    sys.path.insert(0, str(REPO / "tests" / "server_patch"))
    import _routes as routes
    import pdclient_server_patch as plugin
    from conftest import build_chat_renderer
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    if with_plugin:
        plugin.register()
    chat = build_chat_renderer(os.environ["PDCLIENT_TEST_MODEL_DIR"], max_model_len=40960)
    loop = asyncio.new_event_loop()

    def render(body: bytes, parse: bool, parsed: Any = None) -> float:
        start = time.perf_counter()
        request = ChatCompletionRequest.model_validate_json(body) if parse else parsed
        result = loop.run_until_complete(chat.render_chat(request))
        elapsed = time.perf_counter() - start
        assert not hasattr(result, "error"), result
        return elapsed

    def render_route(route: str, body: bytes, parse: bool, parsed: Any = None) -> float:
        """One route's own render step, from its JSON body (``parse``) or a parsed request."""
        start = time.perf_counter()
        if route == "responses":
            request = ResponsesRequest.model_validate_json(body) if parse else parsed
            loop.run_until_complete(routes.render_responses(chat, request))
        else:
            request = routes.messages_to_chat(AnthropicMessagesRequest.model_validate_json(body) if parse else parsed)
            result = loop.run_until_complete(chat.render_chat(request))
            assert not hasattr(result, "error"), result
        return time.perf_counter() - start

    def route_bodies(messages: list[dict[str, str]], kv: dict[str, Any]) -> dict[str, bytes]:
        system, turns = messages[0]["content"], messages[1:]
        responses = {"model": "smol", "input": messages, "max_output_tokens": 16, "kv_transfer_params": kv}
        anthropic = {"model": "smol", "system": system, "messages": turns, "max_tokens": 16, "kv_transfer_params": kv}
        return {"responses": json.dumps(responses).encode(), "messages": json.dumps(anthropic).encode()}

    parsers = {
        "responses": ResponsesRequest.model_validate_json,
        "messages": AnthropicMessagesRequest.model_validate_json,
    }

    rows = []
    for target in sizes:
        scale = 1
        while True:  # grow the conversation until it renders to about target tokens
            messages = conversation(scale)
            base = {"model": "smol", "messages": messages, "max_tokens": 16}
            _, (engine_input,) = loop.run_until_complete(chat.render_chat(ChatCompletionRequest.model_validate(base)))
            ids = list(engine_input["prompt_token_ids"])
            if len(ids) >= target * 0.97:
                break
            scale = max(scale + 1, int(scale * target / max(len(ids), 1)))
        kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2, 3]}
        plain = json.dumps({**base, "kv_transfer_params": kv}).encode()
        forwarded = json.dumps({**base, "kv_transfer_params": {**kv, "prompt_token_ids": ids}}).encode()
        plain_routes = route_bodies(messages, kv)
        forwarded_routes = route_bodies(messages, {**kv, "prompt_token_ids": ids})
        for route in forwarded_routes:
            # Each route renders this conversation to the very ids chat does, and uses them when forwarded.
            request = parsers[route](plain_routes[route])
            own = (
                loop.run_until_complete(routes.render_responses(chat, request))
                if route == "responses"
                else loop.run_until_complete(chat.render_chat(routes.messages_to_chat(request)))[1][0]
            )
            assert list(own["prompt_token_ids"]) == ids, route
        keys = ("tok", "ids", "tok_parse", "ids_parse")
        timings: dict[str, list[float]] = {k: [] for k in keys}
        timings.update({f"{route}_{k}": [] for route in plain_routes for k in keys})
        for i in range(repeats + 3):  # 3 warm-up runs
            pre_plain = ChatCompletionRequest.model_validate_json(plain)
            pre_forwarded = ChatCompletionRequest.model_validate_json(forwarded)
            sample = {
                "tok": render(plain, False, pre_plain),
                "ids": render(forwarded, False, pre_forwarded),
                "tok_parse": render(plain, True),
                "ids_parse": render(forwarded, True),
            }
            for route in plain_routes:
                pre = {name: parsers[route](b[route]) for name, b in (("tok", plain_routes), ("ids", forwarded_routes))}
                sample[f"{route}_tok"] = render_route(route, plain_routes[route], False, pre["tok"])
                sample[f"{route}_ids"] = render_route(route, forwarded_routes[route], False, pre["ids"])
                sample[f"{route}_tok_parse"] = render_route(route, plain_routes[route], True)
                sample[f"{route}_ids_parse"] = render_route(route, forwarded_routes[route], True)
            if i >= 3:
                for key, value in sample.items():
                    timings[key].append(value)
        # The forwarded ids really were used (the engine input is the list sent).
        check = ChatCompletionRequest.model_validate_json(forwarded)
        _, (used,) = loop.run_until_complete(chat.render_chat(check))
        assert used["prompt_token_ids"] == ids and len(ids) > 0
        check_responses = ResponsesRequest.model_validate_json(forwarded_routes["responses"])
        assert loop.run_until_complete(routes.render_responses(chat, check_responses))["prompt_token_ids"] == ids
        check_messages = routes.messages_to_chat(
            AnthropicMessagesRequest.model_validate_json(forwarded_routes["messages"])
        )
        assert loop.run_until_complete(chat.render_chat(check_messages))[1][0]["prompt_token_ids"] == ids
        row = {"tokens": len(ids), **{k: statistics.median(v) * 1e3 for k, v in timings.items()}}
        if not with_plugin:
            plain_chat = json.dumps(base).encode()  # what a client without pdclient sends
            row.update(bytes=len(forwarded), plain_bytes=len(plain_chat), **guard_cost(forwarded, plain_chat, repeats))
        rows.append(row)
    return {
        "version": version,
        "plugin": with_plugin,
        "reuse": plugin.STATE.applied.get("reuse", "native"),
        "rows": rows,
    }


def guard_cost(body: bytes, plain: bytes, repeats: int) -> dict[str, float]:
    """Median ms the guard middleware adds to a request, and pdclient's signing of ``body``.

    ``guard``: a signed request of ``body`` (header parse, expiry, HMAC over the whole
    body, nonce memory; no parse of the body). ``guard_unsigned``: an unsigned body without
    ``kv_transfer_params`` (``plain``: one scan for the key). ``client_sign``: pdclient's
    ``signature()`` over ``body`` (loaded from its file: pdclient is not installed here).
    Each run gets a fresh nonce (made outside the timing), on one event loop, as a server has.
    """
    import asyncio
    import importlib.util

    from pdclient_server_patch import _guard
    from pdclient_server_patch._signing import SIGNATURE_HEADER

    spec = importlib.util.spec_from_file_location("client_signing", REPO / "pdclient" / "wire" / "_signing.py")
    assert spec is not None and spec.loader is not None
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    path = "/v1/chat/completions"
    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"] is not None)

    async def send(message: Any) -> None:
        raise AssertionError(f"the guard refused a benchmark request: {message}")

    middleware = _guard.PDClientMiddleware(app, "bench")
    loop = asyncio.new_event_loop()

    def timed(content: bytes, headers: list[tuple[bytes, bytes]]) -> float:
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": content, "more_body": False}

        start = time.perf_counter()
        loop.run_until_complete(middleware(scope, receive, send))
        return time.perf_counter() - start

    json_type = (b"content-type", b"application/json")
    times: dict[str, list[float]] = {"guard": [], "guard_unsigned": [], "client_sign": []}
    for i in range(repeats + 3):
        header = client.signature("bench", "POST", path, body).encode()
        sample = {
            "guard": timed(body, [json_type, (SIGNATURE_HEADER.encode(), header)]),
            "guard_unsigned": timed(plain, [json_type]),
        }
        start = time.perf_counter()
        client.signature("bench", "POST", path, body)
        sample["client_sign"] = time.perf_counter() - start
        if i >= 3:
            for key, value in sample.items():
                times[key].append(value)
    loop.close()
    assert len(reached) == 2 * (repeats + 3)  # every request went through
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", default="2048,8192,32768")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        version, with_plugin = args.child.split(":")
        print("RESULT " + json.dumps(child(version, with_plugin == "1", sizes, args.repeats)), flush=True)
        return 0

    sys.path[:0] = [str(REPO), str(REPO / "tests" / "server_patch")]
    from _vllm_src import vllm_src

    from pdclient.local._prepare import model_dir, server_python

    python = str(server_python())
    env = dict(os.environ, PDCLIENT_TEST_MODEL_DIR=str(model_dir()), VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="WARNING")
    results = []
    for version, with_plugin in VERSIONS:
        src = vllm_src(version, python)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src) if src else "", str(REPO / "server_patch")) if p)
        cmd = [python, __file__, "--child", f"{version}:{int(with_plugin)}", "--repeats", str(args.repeats)]
        out = subprocess.run([*cmd, "--sizes", args.sizes], env=env, cwd=REPO, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        results.append(json.loads(line[len("RESULT ") :]))

    print(f"decode-side preprocessing, SmolLM2-135M tokenizer, medians of {args.repeats} runs (ms)")
    print(
        "| vLLM | tokens | template+tokenize | forwarded ids | ratio "
        "| parse+render: template | parse+render: ids | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        label = f"{result['version']} {'+ plugin' if result['plugin'] else 'native'}"
        for row in result["rows"]:
            print(
                f"| {label} | {row['tokens']} | {row['tok']:.2f} | {row['ids']:.2f} | {row['tok'] / row['ids']:.1f}x "
                f"| {row['tok_parse']:.2f} | {row['ids_parse']:.2f} | {row['tok_parse'] / row['ids_parse']:.1f}x |"
            )
    print(
        "\nper route: the decode leg's own body (chat, Responses, Messages) parsed and rendered,"
        "\ntemplate+tokenize against forwarded ids, medians (ms) of the same interleaved runs"
    )
    print(
        "| vLLM | route | tokens | render: template | render: ids | ratio "
        "| parse+render: template | parse+render: ids | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        label = f"{result['version']} {'+ plugin' if result['plugin'] else 'native'}"
        for row in result["rows"]:
            for route, prefix in (("chat", ""), ("Responses", "responses_"), ("Messages", "messages_")):
                tok, ids = row[f"{prefix}tok"], row[f"{prefix}ids"]
                tok_parse, ids_parse = row[f"{prefix}tok_parse"], row[f"{prefix}ids_parse"]
                print(
                    f"| {label} | {route} | {row['tokens']} | {tok:.2f} | {ids:.2f} | {tok / ids:.1f}x "
                    f"| {tok_parse:.2f} | {ids_parse:.2f} | {tok_parse / ids_parse:.1f}x |"
                )
    native = results[-1]
    print(
        "\nguard (PDCLIENT_REUSE_SECRET set) on the forwarded-ids body, and pdclient's signing of it, medians (ms);"
        "\nratio = vLLM 0.32's template+tokenize that the forwarded ids save / the guard's check of a signed body"
    )
    print(
        "| tokens | body KB | guard: signed (v2 HMAC, no parse) | unsigned chat body without the key (KB): guard "
        "| client signature() | template+tokenize | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in native["rows"]:
        print(
            f"| {row['tokens']} | {row['bytes'] / 1024:.0f} | {row['guard']:.3f} "
            f"| ({row['plain_bytes'] / 1024:.0f}) {row['guard_unsigned']:.3f} "
            f"| {row['client_sign']:.3f} | {row['tok']:.2f} | {row['tok'] / row['guard']:.0f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
