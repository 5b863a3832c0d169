"""`make demo`: a real prefill/decode pair on this machine, one streamed chat through it.

Starts a prefill and a decode vLLM server (SmolLM2-135M-Instruct, KV moved by NIXL on
CPU buffers), streams an answer through PDChatClient, prints the call's PDTrace, and
stops both servers. The first run also builds the server environment and the model
(a few minutes, cached under ~/.cache/pdclient). With ``PDCLIENT_PREFILL_BASE_URL`` and
``PDCLIENT_DECODE_BASE_URL`` set, it uses those servers instead and starts nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdclient import PDTrace
from pdclient.local import pair_from_env_or_local

QUESTION = "In two sentences, why is the sky blue?"


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
    with pair_from_env_or_local(kv_connector=args.kv_connector) as pd:
        client = pd.client(on_trace=traces.append, dispatch=args.dispatch)
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
            messages=[{"role": "user", "content": QUESTION}],
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
