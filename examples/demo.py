"""`make demo`: a real prefill/decode pair on this machine, one streamed chat through it.

Starts a prefill and a decode vLLM server (SmolLM2-135M-Instruct, KV moved by NIXL on
CPU buffers, each publishing its KV events), streams an answer through PDChatClient,
prints the call's PDTrace, asks a follow-up and prints what decided it (its
``cache_source``: the decode server's own KV events, or the estimator where they do not
say) beside what the decode server then found cached, and stops both servers. The first
run also builds the server environment and the model (a few minutes, cached under
~/.cache/pdclient). With ``PDCLIENT_PREFILL_BASE_URL`` and
``PDCLIENT_DECODE_BASE_URL`` set, it uses those servers instead and starts nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdclient import PDChatClient, PDTrace
from pdclient.local import pair_from_env_or_local

SYSTEM = (
    "You are a patient science teacher. Answer in plain words a curious twelve-year-old follows, "
    "and keep each answer short. Words you may use, with what they mean here: "
    + " ".join(
        f"{word}: {meaning}."
        for word, meaning in (
            ("light", "energy that travels as waves of many lengths, which our eyes see as colours"),
            ("wavelength", "the distance between two crests of a wave; blue is short, red is long"),
            ("atmosphere", "the layer of gases, mostly nitrogen and oxygen, that surrounds the Earth"),
            ("molecule", "the smallest piece of a gas, far smaller than the wavelength of light"),
            ("scattering", "light bouncing off molecules in every direction, short waves far more than long"),
            ("Rayleigh scattering", "the scattering by molecules, stronger for blue light by about five times"),
            ("horizon", "where the sky meets the ground, seen through much more air than straight up"),
            ("sunset", "when the sun is at the horizon and its light crosses the most air to reach us"),
            ("dust", "tiny particles in the air that scatter all colours and make the sky paler"),
            ("eye", "the organ that sees colour with three kinds of cells, most sensitive to green"),
        )
    )
)
"""A system prompt of a few whole KV blocks (128 tokens each on the CPU), so the follow-up
has a cached prefix the decode server's events can name."""
QUESTION = "In two sentences, why is the sky blue?"
FOLLOW_UP = "And why is the sunset red?"


def wait_for_events(client: PDChatClient, decode_urls: list[str], timeout: float = 30.0) -> None:
    """Until the client's view of every decode server's cache is current (else the estimator decides)."""
    feeds = client.pd_fleet.kv_events
    if feeds is None:
        return
    client.pd_fleet.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((index := feeds.index(url)) is not None and index.synced for url in decode_urls):
            return
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kv-connector",
        default="nixl",
        help='the local pair\'s KV connector: "nixl" (pull, the default) or "nixl-push" (vLLM\'s NixlPushConnector)',
    )
    parser.add_argument(
        "--dispatch",
        default="sequential",
        choices=("sequential", "concurrent", "auto"),
        help="how the client sends the two legs (concurrent needs a push-mode pair)",
    )
    args = parser.parse_args()
    # LocalPD reports its long steps (environment, model, server starts) on this logger.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pdclient.local").setLevel(logging.INFO)

    traces: list[PDTrace] = []
    with pair_from_env_or_local(kv_connector=args.kv_connector, kv_events=True) as pd:
        # Servers named in the environment may publish no events: the estimator decides there.
        kv_events = "discover" if pd.local is not None else None
        client = pd.client(on_trace=traces.append, dispatch=args.dispatch, kv_events=kv_events)
        wait_for_events(client, pd.decode_urls)
        if args.dispatch != "sequential":
            # The first call to a prefill endpoint is sequential: its answer gives the
            # coordinates a concurrent decode needs.
            client.chat.completions.create(
                model=pd.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0
            )
        print(f"\nQ: {QUESTION}\nA: ", end="", flush=True)
        parts: list[str] = []
        stream = client.chat.completions.create(
            model=pd.model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            max_tokens=96,
            temperature=0,
            stream=True,
        )
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    print(parts[-1], end="", flush=True)
        print("\n")
        print(f"answer={''.join(parts).strip()!r}")
        # on_trace fires once the decode stream is closed, with the first-byte time.
        for name, value in traces[-1].model_dump(mode="json").items():
            print(f"{name}={value}")
        print()
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "".join(parts)},
            {"role": "user", "content": FOLLOW_UP},
        ]
        time.sleep(0.5)  # the decode's events of the answer's last blocks are on their way
        follow = client.chat.completions.create(model=pd.model, messages=messages, max_tokens=48, temperature=0)  # type: ignore[arg-type]
        trace = traces[-1]
        usage = follow.usage
        details = usage.prompt_tokens_details if usage is not None else None
        print(f"Q: {FOLLOW_UP}\nA: {(follow.choices[0].message.content or '').strip()}\n")
        source = "the decode server's KV events" if trace.cache_source == "kv_events" else "the estimator"
        print(
            f"follow-up: outcome={trace.outcome.value if trace.outcome else None} "
            f"cache_source={trace.cache_source} cached_tokens={trace.cached_tokens} (decided from {source}; "
            f"the decode server found {details.cached_tokens if details else None} of "
            f"{usage.prompt_tokens if usage else None} prompt tokens cached)"
        )
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
