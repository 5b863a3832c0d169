"""Decisions from the servers' own KV events, on a real pair started with them on.

One pair for the module (``LocalPD(kv_events=True)``, with ``VLLM_SERVER_DEV_MODE=1`` for
``POST /reset_prefix_cache``); a client reads both servers' events (``kv_events="discover"``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pdclient import Outcome, PDChatClient, PDTrace
from pdclient.conversations import decide_remote_prefill
from pdclient.kv_events import KVIndex
from pdclient.local import LocalPD
from pdclient.wire import Kind, affinity_key
from tests.serve.process import ServeProcess, metric_samples

from .helpers import GREEDY

BLOCK = 128  # vLLM's CPU block size, the memory's default
WORKER_CONVERSATIONS = 40


REQUEST_INPUTS_LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "vllm": {
            "()": "vllm.logging_utils.NewLineFormatter",
            "datefmt": "%m-%d %H:%M:%S",
            "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
            "[%(fileinfo)s:%(lineno)d] %(message)s",
        }
    },
    "handlers": {
        "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "DEBUG", "stream": "ext://sys.stdout"}
    },
    "loggers": {
        "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        "vllm.entrypoints.serve.utils.request_logger": {"level": "DEBUG"},
    },
}
"""vLLM's own logging, but for its request logger's inputs line (DEBUG): each request's engine
input as its server made it, ``prompt`` the text it rendered (None: it took ids given)."""


@pytest.fixture(scope="module")
def events_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    logging_config = tmp_path_factory.mktemp("vllm-logging") / "logging.json"
    logging_config.write_text(json.dumps(REQUEST_INPUTS_LOGGING))
    with LocalPD(
        kv_events=True,
        server_env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_CONFIG_PATH": str(logging_config)},
        extra_server_args=("--enable-log-requests",),
    ) as pd:
        yield pd


def engine_input(pd: LocalPD, leg_id: str) -> str:
    """What the decode server's request logger says it gave its engine for the request with
    ``leg_id`` (its ``x-request-id``): ``prompt: '<text>'`` when it rendered the messages,
    ``prompt: None`` when it took ids it was given."""
    assert pd.decode is not None
    marker = f"Request chatcmpl-{leg_id} details: "
    wait_for(lambda: marker in pd.decode.log_path.read_text(errors="replace"), "the request's inputs in the log")  # type: ignore[union-attr]
    line = next(line for line in pd.decode.log_path.read_text(errors="replace").splitlines() if marker in line)
    return line.split(marker, 1)[1]


def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def decode_index(client: PDChatClient, pd: LocalPD) -> KVIndex:
    feeds = client.pd_fleet.kv_events
    assert feeds is not None
    wait_for(lambda: feeds.index(pd.decode_urls[0]) is not None, "the decode's subscription")
    index = feeds.index(pd.decode_urls[0])
    assert index is not None
    return index


@contextlib.contextmanager
def events_client(pd: LocalPD, traces: list[PDTrace], **options: Any) -> Iterator[tuple[PDChatClient, KVIndex]]:
    """An ``auto`` client reading both servers' events (``kv_events="discover"``), its fleet
    started, and the decode's index once its view is current."""
    with PDChatClient(
        prefill_base_url=pd.prefill_urls,
        decode_base_url=pd.decode_urls,
        api_key="EMPTY",
        remote_prefill="auto",
        kv_events="discover",
        on_trace=traces.append,
        **options,
    ) as client:
        client.pd_fleet.start()
        index = decode_index(client, pd)
        wait_for(lambda: index.synced, "the decode's view to catch up")
        yield client, index


def conversation() -> list[dict[str, Any]]:
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 40
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me a short story about the robot in the notes."},
    ]


def test_a_turn_after_the_decodes_reset_is_a_handoff_by_its_events(events_pair: LocalPD) -> None:
    pd = events_pair
    traces: list[PDTrace] = []
    with events_client(pd, traces) as (client, _index):
        turn1 = conversation()
        first = client.chat.completions.create(model=pd.model, messages=turn1, **GREEDY)  # type: ignore[arg-type]
        assert traces[0].outcome is Outcome.DISAGGREGATED
        prompt_tokens = first.usage.prompt_tokens if first.usage else 0
        # The decode server announces the blocks it pulled over NIXL as its own (BlockStored).
        held_keys = client.pd_fleet.memory._turns[next(reversed(client.pd_fleet.memory._turns))].turn().prompt_keys
        assert len(held_keys) == 8 * (prompt_tokens // BLOCK)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Give it a title."},
        ]
        second = client.chat.completions.create(model=pd.model, messages=turn2, **GREEDY)  # type: ignore[arg-type]
        t2 = traces[1]
        assert (t2.outcome, t2.cache_source) == (Outcome.DECODE_ONLY, "kv_events")
        # Never more cached than the decode server itself found (its usage, the truth).
        truth = second.usage.prompt_tokens_details.cached_tokens if second.usage else None  # type: ignore[union-attr]
        assert truth is not None and t2.cached_tokens is not None and t2.cached_tokens <= truth
        print(f"\nturn 2: decided cached {t2.cached_tokens}, the decode server found {truth} cached", end="")

        reset_prefix_caches(pd.model, pd.decode_urls[0])
        turn3 = [
            *turn2,
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "And a moral?"},
        ]
        memory = client.pd_fleet.memory
        key = affinity_key(Kind.CHAT, turn3, None, None)
        body = {"model": pd.model, "messages": turn3}
        admitted = [e.url for e in client.pd_fleet.decode.admitted()]
        wait_for(
            lambda: memory.estimate(key, body, admitted, held=client.pd_fleet.kv_events.held_tokens).cached_tokens == 0,  # type: ignore[union-attr]
            "the reset in the decode's events",
        )
        # The estimator alone, on the same memory: the conversation would still be cached.
        alone = decide_remote_prefill("auto", memory.estimate(key, body, admitted), client.pd_options.conversations)
        assert (alone.remote_prefill, alone.estimate.cache_source) == (False, "estimate")  # type: ignore[union-attr]
        client.chat.completions.create(model=pd.model, messages=turn3, **GREEDY)  # type: ignore[arg-type]
        t3 = traces[2]
        assert (t3.outcome, t3.remote_prefill_reason, t3.cache_source, t3.cached_tokens) == (
            Outcome.DISAGGREGATED,
            "uncached_ratio_at_or_above",  # all of it uncached now
            "kv_events",
            0,
        )
        print(
            f"; turn 3 after the reset: estimator alone {alone.estimate.cached_tokens} cached (decode-only), "  # type: ignore[union-attr]
            f"events 0 (a handoff)",
            end="",
        )


def settled(index: KVIndex, quiet: float = 0.5, timeout: float = 15.0) -> None:
    """Wait until the endpoint's events have been quiet for ``quiet`` seconds: the blocks of
    the call that just ended are in its index (they are published with its last steps)."""
    deadline = time.monotonic() + timeout
    last, since = index.last_seq, time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the decode's events never went quiet"
        time.sleep(0.05)
        if index.last_seq != last:
            last, since = index.last_seq, time.monotonic()


def test_a_decode_only_follow_up_is_counted_as_the_decode_server_counts_it(events_pair: LocalPD) -> None:
    """The answer's ids (asked of the decode leg) key its blocks: a decode-only follow-up's
    cached count, from the decode's events, is what the decode server itself then finds
    cached (its usage), after a P/D turn and after a decode-only one."""
    pd = events_pair
    traces: list[PDTrace] = []
    with events_client(pd, traces) as (client, index):
        messages = conversation()
        questions = ["Give it a title.", "And a moral?"]
        answer = client.chat.completions.create(model=pd.model, messages=messages, temperature=0, max_tokens=150)  # type: ignore[arg-type]
        assert traces[-1].outcome is Outcome.DISAGGREGATED
        counts = []
        for question in questions:
            settled(index)
            messages = [
                *messages,
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": question},
            ]
            answer = client.chat.completions.create(model=pd.model, messages=messages, temperature=0, max_tokens=150)  # type: ignore[arg-type]
            trace = traces[-1]
            truth = answer.usage.prompt_tokens_details.cached_tokens if answer.usage else None  # type: ignore[union-attr]
            counts.append((trace.cached_tokens, truth, trace.estimated_prompt_tokens))
            assert (trace.outcome, trace.cache_source) == (Outcome.DECODE_ONLY, "kv_events")
            assert trace.cached_tokens == truth, counts
        print(f"\n(decided cached, the decode server's cached, prompt) per follow-up: {counts}", end="")


def test_two_client_processes_make_the_same_decision_for_the_same_call(events_pair: LocalPD) -> None:
    """Nothing shared but the servers' events: two processes, one after the other, each
    running the same two turns of a conversation on servers that hold none of it, decide its
    follow-up alike (decode-only, from the events, the same cached count: the decode
    server's own for the first)."""
    pd = events_pair
    calls = [conversation(), "Give it a title."]
    decisions = []
    for _ in range(2):
        # Both prefix caches emptied first, so the second process's first turn is computed as
        # the first's was (a handoff, nothing cached). On the first's cache it would go
        # decode-only, other kernels would compute its last block, and at a near-tie the greedy
        # answer went another way (seen on an AVX2-only EPYC, three conversations in a row):
        # then the two follow-ups are not the same call.
        reset_prefix_caches(pd.model, *pd.prefill_urls, *pd.decode_urls)
        run = subprocess.run(
            [sys.executable, "-m", "tests.pair.kv_events_decider", pd.prefill_urls[0], pd.decode_urls[0], pd.model],
            input=json.dumps(calls),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        decisions.append([json.loads(line) for line in run.stdout.splitlines()])
    (a1, a2), (b1, b2) = decisions
    assert a1["outcome"] == b1["outcome"] == Outcome.DISAGGREGATED.value, decisions
    assert a1["answer"] == b1["answer"], decisions
    follow_ups = [{name: value for name, value in d[1].items() if name != "answer"} for d in decisions]
    print(f"\nthe follow-up, per process: {follow_ups}", end="")
    assert a2["outcome"] == b2["outcome"] == Outcome.DECODE_ONLY.value
    assert a2["cache_source"] == b2["cache_source"] == "kv_events"
    # The same call on the same servers' state: the same count, the decode server's own.
    assert a2["cached_tokens"] == b2["cached_tokens"] == a2["decode_cached_tokens"] == b2["decode_cached_tokens"]


def reset_prefix_caches(model: str, *urls: str) -> None:
    """Empty these servers' prefix caches, and have each publish it (vLLM sends a reset's
    AllBlocksCleared with its next engine step: any call makes one)."""
    for url in urls:
        assert httpx.post(url.removesuffix("/v1") + "/reset_prefix_cache", timeout=30).json() == {"success": True}
        httpx.post(
            url + "/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            timeout=60,
        ).raise_for_status()


def few_shot() -> list[dict[str, Any]]:
    """A history no server answered: the assistant turn is the caller's own invention."""
    system = f"Few-shot {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 40
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me a short story about the robot in the notes."},
        {"role": "assistant", "content": "At dawn the robot painted the sky orange, then slept until noon."},
        {"role": "user", "content": "Another one, about the evening."},
    ]


def test_a_history_never_seen_is_decode_only_only_when_the_decode_holds_it(events_pair: LocalPD) -> None:
    """Fresh clients (no memory of any turn), a made-up few-shot history: its prompt's ids
    come from the prefill server's /tokenize, and the decode's events say what it holds of
    them. Not held: a handoff, and the decode server's metrics say it found nothing cached.
    The same history after that handoff put it in the decode's cache, through another fresh
    client: decode-only, counting what the decode server then reports cached."""
    pd = events_pair
    decode = pd.decode_urls[0]
    messages = few_shot()
    body = {"model": pd.model, "messages": messages}
    key = affinity_key(Kind.CHAT, messages, None, None)
    costs = []
    traces: list[PDTrace] = []
    with events_client(pd, traces) as (client, index):
        # What this client would decide without the ids: the estimate, on the call's word.
        before = client.pd_fleet.memory.estimate(key, body, [decode], decode)
        alone = decide_remote_prefill("auto", before, client.pd_options.conversations)
        hits = tokens_by_source(decode, "local_cache_hit")
        answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
        t1 = traces[-1]
        assert (t1.outcome, t1.conversation, t1.cache_source, t1.cached_tokens) == (
            Outcome.DISAGGREGATED,
            "unseen_history" if before.match.value == "unseen_history" else "extends_history",
            "kv_events",
            0,
        )
        assert answer.usage is not None and t1.estimated_prompt_tokens == answer.usage.prompt_tokens  # the ids' count
        assert tokens_by_source(decode, "local_cache_hit") - hits == 0  # the decode held none of it
        assert t1.tokenize_ms is not None
        costs.append(t1.tokenize_ms)
        settled(index)
    traces = []
    with events_client(pd, traces) as (client, index):
        answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
        t2 = traces[-1]
        truth = answer.usage.prompt_tokens_details.cached_tokens if answer.usage else None  # type: ignore[union-attr]
        assert (t2.outcome, t2.cache_source) == (Outcome.DECODE_ONLY, "kv_events")
        assert t2.cached_tokens == truth and truth and truth > 0
        assert t2.tokenize_ms is not None
        costs.append(t2.tokenize_ms)
    # /tokenize on its own, as the client sends it, for this prompt and one near the model's length.
    direct = {}
    long = [{**messages[0], "content": messages[0]["content"] * 3}, *messages[1:]]
    with httpx.Client(timeout=10) as http:
        for name, asked in (("this prompt", messages), ("a long one", long)):
            times, count = [], 0
            for _ in range(7):
                started = time.perf_counter()
                answered = http.post(
                    pd.prefill_urls[0].removesuffix("/v1") + "/tokenize", json={"model": pd.model, "messages": asked}
                )
                times.append((time.perf_counter() - started) * 1000)
                count = answered.json()["count"]
            direct[f"{name} ({count} ids)"] = round(sorted(times)[3], 1)
    print(
        f"\nunseen history of {t1.estimated_prompt_tokens} tokens: without the ids, estimate "
        f"{before.cached_tokens} cached ({before.match.value}) -> "
        f"{'handoff' if alone.remote_prefill else 'decode-only'} ({alone.reason.value}); "
        f"with them: a handoff (0 held), then decode-only ({t2.cached_tokens} held, the server's {truth}); "
        f"/tokenize in the calls {', '.join(f'{ms:.1f}' for ms in costs)} ms, alone (median of 7) {direct} ms",
        end="",
    )


def test_a_decode_only_call_after_a_tokenize_hands_the_decode_its_ids(events_pair: LocalPD) -> None:
    """A fresh client, a made-up history the decode server holds (its own call of it): the
    follow-up goes decode-only by the events after a /tokenize, and its decode leg carries
    the ids /tokenize gave. The decode server's request logger says it took them and
    rendered nothing (``prompt: None``), where the same messages sent to it without ids
    were rendered there; and its answer, its prompt's ids and its usage are the server's
    own for those messages, asked again right after on the same cache."""
    pd = events_pair
    decode = pd.decode_urls[0]
    messages = few_shot()
    body = {"model": pd.model, "messages": messages, **GREEDY, "return_token_ids": True}
    with httpx.Client(timeout=120) as http:
        http.post(decode + "/chat/completions", json=body).raise_for_status()  # the decode caches the history
        traces: list[PDTrace] = []
        with events_client(pd, traces) as (client, index):
            settled(index)
            raw = client.chat.completions.with_raw_response.create(
                model=pd.model,
                messages=messages,  # type: ignore[arg-type]
                **GREEDY,
                extra_body={"return_token_ids": True},
            )
        ours = raw.http_response.json()
        trace = traces[-1]
        own_id = f"kv-reference-{uuid.uuid4().hex}"
        own = http.post(decode + "/chat/completions", json=body, headers={"x-request-id": own_id})
        own.raise_for_status()
    reference = own.json()
    assert (trace.outcome, trace.cache_source) == (Outcome.DECODE_ONLY, "kv_events")
    assert trace.tokenize_ms is not None
    assert trace.forwarded_tokens == len(reference["prompt_token_ids"]) == ours["usage"]["prompt_tokens"]
    # The server's own account of each request's engine input.
    ours_input, own_input = engine_input(pd, trace.leg_request_id), engine_input(pd, own_id)
    assert ours_input.startswith("prompt: None, prompt_token_ids: ["), ours_input[:200]
    assert own_input.startswith("prompt: '<|im_start|>"), own_input[:200]
    # The ids it took are the ones it renders itself, and so its answer and usage are its own.
    assert ours["prompt_token_ids"] == reference["prompt_token_ids"]
    assert ours["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    counts = ("prompt_tokens", "completion_tokens")
    assert [ours["usage"][name] for name in counts] == [reference["usage"][name] for name in counts]
    cached = ours["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == reference["usage"]["prompt_tokens_details"]["cached_tokens"] == trace.cached_tokens
    print(
        f"\ndecode-only after /tokenize ({trace.tokenize_ms:.1f} ms): {trace.forwarded_tokens} ids forwarded, "
        f"{trace.cached_tokens} decided cached, the server's {cached}; "
        f"its engine input: ours {ours_input[:40]!r}..., without ids {own_input[:40]!r}...",
        end="",
    )


def proxy_call(proxy: ServeProcess, messages: list[dict[str, Any]], model: str) -> tuple[dict[str, Any], int]:
    """One chat call through the proxy on a new connection (the kernel hands it to either
    worker): the call's trace headers, the decode's cached count, and the worker's pid (from
    its JSON call line, by the request id the call carried)."""
    request_id = f"kv-workers-{uuid.uuid4().hex}"
    response = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": model, "messages": messages, **GREEDY},
        headers={"x-request-id": request_id},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    trace = PDTrace.from_headers(response.headers)
    usage = response.json()["usage"]
    found: list[int] = []

    def logged() -> bool:
        for line in list(proxy.lines):
            if request_id in line and line.startswith("{"):
                entry = json.loads(line)
                if entry.get("request_id") == request_id and "pid" in entry:
                    found.append(entry["pid"])
                    return True
        return False

    wait_for(logged, "the call's log line")
    decision = {
        "outcome": trace.outcome.value if trace.outcome else None,
        "cache_source": trace.cache_source,
        "cached_tokens": trace.cached_tokens,
        "decode_cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "tokenize_ms": trace.tokenize_ms,
        "answer": response.json()["choices"][0]["message"]["content"],
    }
    return decision, found[0]


def test_two_workers_of_one_proxy_decide_alike_and_as_the_decode_counts(events_pair: LocalPD) -> None:
    """``pdclient serve --workers 2``, each worker with its own subscriptions and memory:
    two-turn conversations, each call on a new connection (either worker may take either
    turn), until a follow-up went to the worker that never saw its first turn. Every
    follow-up is decode-only by the decode's events, counting what the decode server itself
    then found cached, whichever worker decided it.

    Which worker accepts a connection is the kernel's choice, and it can favour one: in a CI
    run one worker took 15 of 16 calls, and the only crossing was its first turn on the
    other. So the test waits for a crossing (up to ``WORKER_CONVERSATIONS``), not for each
    worker to decide a follow-up: the crossed worker decided one from events it alone read."""
    pd = events_pair
    proxy = ServeProcess(
        *("--prefill", pd.prefill_urls[0], "--decode", pd.decode_urls[0], "--remote-prefill", "auto"),
        *("--kv-events", "discover", "--trace-headers", "--log-format", "json"),
        workers=2,
    )
    follow_ups: list[tuple[int, int, dict[str, Any]]] = []
    try:
        with events_client(pd, []) as (_client, index):
            # Both workers subscribe in their fleets' background: give them the time this one took.
            time.sleep(2.0)
            for _ in range(WORKER_CONVERSATIONS):
                messages = conversation()
                first, first_pid = proxy_call(proxy, messages, pd.model)
                assert first["outcome"] == Outcome.DISAGGREGATED.value
                settled(index)
                messages = [
                    *messages,
                    {"role": "assistant", "content": first["answer"]},
                    {"role": "user", "content": "Give it a title."},
                ]
                second, second_pid = proxy_call(proxy, messages, pd.model)
                second.pop("answer")
                follow_ups.append((first_pid, second_pid, second))
                if any(a != b for a, b, _ in follow_ups):
                    break
                settled(index)
    finally:
        proxy.stop()
    print(f"\n(first turn's worker, follow-up's worker, its decision) per conversation: {follow_ups}", end="")
    assert any(a != b for a, b, _ in follow_ups), "no follow-up went to the other worker"
    for _, _, decision in follow_ups:
        assert (decision["outcome"], decision["cache_source"]) == (Outcome.DECODE_ONLY.value, "kv_events")
        assert decision["cached_tokens"] == decision["decode_cached_tokens"], follow_ups


def tokens_by_source(base_v1_url: str, source: str) -> float:
    """A vLLM server's prompt tokens of one source so far (``local_cache_hit``: found in its
    own prefix cache; ``external_kv_transfer``: pulled over NIXL; ``local_compute``)."""
    text = httpx.get(base_v1_url.removesuffix("/v1") + "/metrics", timeout=10).text
    samples = metric_samples(text)
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "vllm:prompt_tokens_by_source_total" and ("source", source) in labels
    )


def answering(base_v1_url: str) -> bool:
    try:
        return httpx.get(base_v1_url.removesuffix("/v1") + "/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_decode_restart_is_seen_at_once_and_its_next_turn_is_a_handoff(events_pair: LocalPD) -> None:
    """The decode server restarts (a new process on its ports: an empty cache, a new event
    stream): the client's index goes unknown when its publisher goes, and is current again
    (empty) by the time the server answers; meanwhile no estimate counts the old view's
    blocks; the next follow-up is a handoff by the events, and the restarted server's own
    metrics say it found nothing in its cache. Runs last in the module: the restart."""
    pd = events_pair
    traces: list[PDTrace] = []
    with events_client(pd, traces) as (client, index):
        messages = conversation()
        answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
        assert traces[-1].outcome is Outcome.DISAGGREGATED

        def follow_up(question: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            turn = [*messages, {"role": "assistant", "content": answer.choices[0].message.content}]
            turn.append({"role": "user", "content": question})
            return turn, {"model": pd.model, "messages": turn}

        settled(index)
        messages, body = follow_up("Give it a title.")
        answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
        truth = answer.usage.prompt_tokens_details.cached_tokens if answer.usage else None  # type: ignore[union-attr]
        assert (traces[-1].outcome, traces[-1].cache_source, traces[-1].cached_tokens) == (
            Outcome.DECODE_ONLY,
            "kv_events",
            truth,
        )
        settled(index)
        messages, body = follow_up("And a moral?")
        memory, feeds = client.pd_fleet.memory, client.pd_fleet.kv_events
        assert feeds is not None
        key = affinity_key(Kind.CHAT, messages, None, None)
        decode = pd.decode_urls[0]

        def estimate() -> Any:
            return memory.estimate(key, body, [decode], held=feeds.held_tokens)

        assert (estimate().cache_source, estimate().cached_tokens > 0) == ("kv_events", True)

        restarted: list[BaseException | None] = []

        def restart() -> None:
            try:
                assert pd.decode is not None
                pd.restart(pd.decode)
                restarted.append(None)
            except BaseException as exc:
                restarted.append(exc)

        worker = threading.Thread(target=restart, daemon=True)
        t0 = time.monotonic()
        worker.start()
        down = unknown = None
        stale: list[tuple[float, int]] = []
        while worker.is_alive():
            now = time.monotonic() - t0
            if down is None and not answering(decode):
                down = now
            if unknown is None and not index.synced:
                unknown = now
            seen = estimate()
            if down is not None and seen.cache_source == "kv_events" and seen.cached_tokens > 0:
                stale.append((now, seen.cached_tokens))
            time.sleep(0.02)
        assert restarted == [None], restarted
        ready = time.monotonic() - t0
        wait_for(lambda: index.synced, "the restarted decode's view", timeout=5)
        synced = time.monotonic() - t0
        print(
            f"\nrestart: API down at {down:.2f} s, index unknown at {unknown:.2f} s, server ready at {ready:.2f} s, "
            f"index current at {synced:.2f} s; estimates on the old view after the API went down: "
            f"{len(stale)}, the last at {stale[-1][0] if stale else None}",
            end="",
        )
        assert down is not None and unknown is not None
        # The publisher's going is seen within a second of the API's (its engine stops after
        # its API server): only until then may an estimate count the old view's blocks.
        assert unknown - down < 1.0
        assert all(at < down + 1.0 for at, _ in stale), stale
        assert synced - ready < 1.0
        assert (estimate().cache_source, estimate().cached_tokens) == ("kv_events", 0)

        hits, pulled = tokens_by_source(decode, "local_cache_hit"), tokens_by_source(decode, "external_kv_transfer")
        answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
        t3 = traces[-1]
        assert (t3.outcome, t3.cache_source, t3.cached_tokens) == (Outcome.DISAGGREGATED, "kv_events", 0)
        # The server's own account: nothing of the conversation in its cache, all of it pulled.
        assert tokens_by_source(decode, "local_cache_hit") - hits == 0
        assert tokens_by_source(decode, "external_kv_transfer") - pulled > 0

        settled(index)
        messages, body = follow_up("Who else is in the story?")
        answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
        truth = answer.usage.prompt_tokens_details.cached_tokens if answer.usage else None  # type: ignore[union-attr]
        # The index built again from the new stream counts as the restarted server does.
        assert (traces[-1].outcome, traces[-1].cache_source, traces[-1].cached_tokens) == (
            Outcome.DECODE_ONLY,
            "kv_events",
            truth,
        )
