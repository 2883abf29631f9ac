"""8 streaming clients at once through the official OpenAI SDK (AsyncOpenAI) against `perch serve`.
Prints one JSON object: each stream's text, finish reason and chunk count, in order.

    python concurrent_client.py BASE_URL API_KEY MODEL
"""
import asyncio
import json
import sys

import openai

base_url, key, model = sys.argv[1:4]
CLIENTS = 8


async def one(client, k):
    messages = [{"role": "user", "content": f"Count from {k} to {k + 20}, one number per line."}]
    pieces, finish, chunks = [], None, 0
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True)
    async for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return {"content": "".join(pieces), "finish_reason": finish, "chunks": chunks}


async def main():
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        results = await asyncio.gather(*(one(client, k) for k in range(CLIENTS)))
    print(json.dumps({"streams": results}))


asyncio.run(main())
