// Stream one chat through `pdclient serve` with the npm openai package.
// Usage: node stream_chat.cjs <node_modules dir>
// Env: PROXY_BASE_URL, PROXY_API_KEY; PROXY_MODEL, PROXY_PROMPT, PROXY_MAX_TOKENS (greedy) for a real model.
// Prints one JSON line per chunk as it arrives, then one line {"done": true, "text": ...}.
"use strict";
const path = require("node:path");
const { createRequire } = require("node:module");

const load = createRequire(path.join(process.argv[2], "noop.js"));
const OpenAI = load("openai").default ?? load("openai");

async function main() {
  const client = new OpenAI({ baseURL: process.env.PROXY_BASE_URL, apiKey: process.env.PROXY_API_KEY || "-", maxRetries: 0 });
  const request = {
    model: process.env.PROXY_MODEL || "stub-model",
    messages: [{ role: "user", content: process.env.PROXY_PROMPT || "Say hello." }],
    stream: true,
  };
  if (process.env.PROXY_MAX_TOKENS) {
    request.max_tokens = Number(process.env.PROXY_MAX_TOKENS);
    request.temperature = 0;
  }
  const stream = await client.chat.completions.create(request);
  let text = "";
  for await (const chunk of stream) {
    const delta = chunk.choices[0]?.delta?.content ?? "";
    text += delta;
    console.log(JSON.stringify({ delta })); // one line per chunk, as it arrives
  }
  console.log(JSON.stringify({ done: true, text }));
}

main().catch((error) => {
  console.error(String(error?.stack || error));
  process.exit(1);
});
