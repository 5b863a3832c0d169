"""Stream a chat answer through PDChatClient, a drop-in openai.OpenAI, and print its PDTrace."""

from __future__ import annotations

from _pair import pd_pair

from pdclient import PDChatClient, PDTrace


def main() -> None:
    traces: list[PDTrace] = []
    with pd_pair() as pair:
        client = PDChatClient(
            prefill_base_url=pair.prefill_urls,
            decode_base_url=pair.decode_urls,
            api_key="EMPTY",
            on_trace=traces.append,  # called once per call, when its decode response is closed
        )
        stream = client.chat.completions.create(
            model=pair.model,
            messages=[{"role": "user", "content": "Name three primary colors."}],
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
        trace = traces[-1]
        print(
            f"prefill {trace.prefill_ms:.0f} ms, decode first byte {trace.decode_first_byte_ms:.0f} ms, "
            f"{trace.forwarded_tokens} prompt ids forwarded, fallback={trace.fallback}"
        )


if __name__ == "__main__":
    main()
