"""AsyncPDChatClient: several chats at once with asyncio, each its own P/D handoff."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from _pair import pd_pair

from pdclient import AsyncPDChatClient, PDTrace

QUESTIONS = ["What is the capital of France?", "What is 2 + 2?", "Name a large ocean."]


async def ask(client: AsyncPDChatClient, model: str, question: str) -> str:
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
    )
    return response.choices[0].message.content or ""


async def run(prefill_urls: Sequence[str], decode_urls: Sequence[str], model: str) -> None:
    traces: list[PDTrace] = []
    async with AsyncPDChatClient(
        prefill_base_url=prefill_urls, decode_base_url=decode_urls, api_key="EMPTY", on_trace=traces.append
    ) as client:
        answers = await asyncio.gather(*(ask(client, model, q) for q in QUESTIONS))
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer.strip()}\n")
    print(f"{len(traces)} handoffs, ids forwarded on {sum(t.forwarded_tokens > 0 for t in traces)}")


def main() -> None:
    with pd_pair() as pair:
        asyncio.run(run(pair.prefill_urls, pair.decode_urls, pair.model))


if __name__ == "__main__":
    main()
