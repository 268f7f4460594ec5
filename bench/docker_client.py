"""The requests bench/docker_check.sh sends, with the official openai client, to the Docker container and to a
native `kvllm serve` of the same model: a completion, a chat, a streamed chat, and a completion with per-request
Kara compression. All greedy (temperature 0), so the two servers must answer with the same tokens.

    .venv/bin/python -m bench.docker_client --base-url http://127.0.0.1:8000 --out answers.json

Writes one JSON object (text and token strings per request, the compression rounds the Kara request ran) and
exits non-zero when an answer is malformed: empty text, a stream that differs from the same request unstreamed,
or a Kara request that compressed nothing.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request

from openai import OpenAI

MAX_TOKENS = 24
# Small window and buffer with compress_prompt, so the ~200-token prompt below is compressed right after prefill.
KARA = {"method": "kara", "ratio": 0.5, "window": 64, "buffer": 16, "compress_prompt": True}
KARA_PROMPT = ("Here is a list of facts. " + " ".join(f"Fact {i}: item {i} weighs {3 * i + 1} grams." for i in range(16))
               + " Question: how much does item 7 weigh? Answer:")


def compression_rounds(base_url: str) -> float:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    m = re.search(r"^kvllm:compression_rounds_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run(base_url: str, model: str) -> dict:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    out: dict = {"model": [m.id for m in client.models.list().data]}

    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=0)
    out["completion"] = {"text": c.choices[0].text, "tokens": c.choices[0].logprobs.tokens,
                         "finish_reason": c.choices[0].finish_reason}

    messages = [{"role": "user", "content": "Name three primary colors."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True)
    out["chat"] = {"text": chat.choices[0].message.content,
                   "tokens": [t.token for t in chat.choices[0].logprobs.content],
                   "finish_reason": chat.choices[0].finish_reason}

    pieces, usage = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    out["chat_stream"] = {"text": "".join(pieces), "chunks": len(pieces), "completion_tokens": usage}

    before = compression_rounds(base_url)
    k = client.completions.create(model=model, prompt=KARA_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=0, extra_body={"kv_compression": KARA})
    out["kara"] = {"settings": KARA, "text": k.choices[0].text, "tokens": k.choices[0].logprobs.tokens,
                   "prompt_tokens": k.usage.prompt_tokens,
                   "compression_rounds": compression_rounds(base_url) - before}
    return out


def problems(out: dict) -> list[str]:
    found = []
    for name in ("completion", "chat", "kara"):
        if not out[name]["text"] or not out[name]["tokens"]:
            found.append(f"{name}: empty answer")
    if out["chat_stream"]["text"] != out["chat"]["text"]:
        found.append(f"chat_stream: {out['chat_stream']['text']!r} != chat {out['chat']['text']!r}")
    if out["chat_stream"]["completion_tokens"] != len(out["chat"]["tokens"]):
        found.append(f"chat_stream: usage says {out['chat_stream']['completion_tokens']} tokens, "
                     f"the chat had {len(out['chat']['tokens'])}")
    if out["kara"]["compression_rounds"] <= 0:
        found.append("kara: the request ran no compression round (kvllm:compression_rounds_total unchanged)")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", required=True, help="JSON file for the answers")
    args = ap.parse_args()
    out = run(args.base_url.rstrip("/"), args.model)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    for p in problems(out):
        print(f"docker_client: {p}", file=sys.stderr)
    print(f"docker_client: completion {out['completion']['text']!r}, kara rounds {out['kara']['compression_rounds']:g}")
    return 1 if problems(out) else 0


if __name__ == "__main__":
    sys.exit(main())
