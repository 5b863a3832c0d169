"""LlamaIndex's OpenAILike against a base URL: one chat, then the same chat streamed.

Run in its own venv (requirements-llamaindex.txt) by tests/pair/test_serve.py:
``python llamaindex_chat.py BASE_URL MODEL PROMPT MAX_TOKENS``; prints one JSON line
``{"chat": text, "stream": [pieces]}``.
"""

import json
import sys

from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike


def main() -> None:
    base_url, model, prompt, max_tokens = sys.argv[1:5]
    llm = OpenAILike(
        model=model,
        api_base=base_url,
        api_key="-",
        is_chat_model=True,
        temperature=0,
        max_tokens=int(max_tokens),
        max_retries=0,
    )
    messages = [ChatMessage(role="user", content=prompt)]
    chat = llm.chat(messages).message.content
    stream = [piece.delta or "" for piece in llm.stream_chat(messages)]
    print(json.dumps({"chat": chat, "stream": stream}))


if __name__ == "__main__":
    main()
