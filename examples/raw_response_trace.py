"""Read a call's PDTrace from its response headers, through the SDK's with_raw_response."""

from __future__ import annotations

from _pair import pd_pair

from pdclient import PDChatClient, PDTrace


def main() -> None:
    with pd_pair() as pair:
        client = PDChatClient(prefill_base_url=pair.prefill_urls, decode_base_url=pair.decode_urls, api_key="EMPTY")
        raw = client.chat.completions.with_raw_response.create(
            model=pair.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0
        )
        completion = raw.parse()  # the usual ChatCompletion
        print("answer:", completion.choices[0].message.content)
        for name, value in raw.headers.items():
            if name.startswith("x-pd-"):
                print(f"  {name}: {value}")
        # The same fields as a PDTrace (all but decode_first_byte_ms, known only after the body).
        trace = PDTrace.from_headers(raw.headers)
        print("forwarded_tokens =", trace.forwarded_tokens)


if __name__ == "__main__":
    main()
