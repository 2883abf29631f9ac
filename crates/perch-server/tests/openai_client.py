"""The official OpenAI Python SDK against `perch serve`: prints one JSON object of what it saw.

    python openai_client.py BASE_URL API_KEY MODEL SYSTEM_PROMPT
"""
import json
import sys
import urllib.error
import urllib.request

import openai

base_url, key, model, system = sys.argv[1:5]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
messages = [
    {"role": "developer", "content": system},
    {"role": "user", "content": [{"type": "text", "text": "Name three colors of the rainbow."}]},
]
out = {"sdk": openai.__version__}

out["models"] = [m.id for m in client.models.list().data]

plain = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
out["plain"] = {
    "content": plain.choices[0].message.content,
    "role": plain.choices[0].message.role,
    "finish_reason": plain.choices[0].finish_reason,
    "usage": plain.usage.model_dump(),
}

pieces, finish, usage, chunks = [], None, None, 0
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for choice in chunk.choices:
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
out["stream"] = {"content": "".join(pieces), "finish_reason": finish, "usage": usage, "chunks": chunks}

# Usage only when asked: no chunk carries it otherwise.
quiet = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, stream=True)
out["stream_without_usage_has_usage"] = any(c.usage is not None for c in quiet)

# A stop sequence taken from the greedy answer: the text ends before it.
words = out["plain"]["content"].split()
stop = words[2] if len(words) > 2 else words[-1]
stopped = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stop=[stop])
out["stop"] = {"stop": stop, "content": stopped.choices[0].message.content,
               "finish_reason": stopped.choices[0].finish_reason}

def error_of(call):
    try:
        call()
    except openai.APIStatusError as e:
        return {"status": e.status_code, "body": e.body}
    return None

out["n2"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages, n=2))
out["unknown_model"] = error_of(lambda: client.chat.completions.create(model="no-such-model", messages=messages))
long = [{"role": "user", "content": "word " * 10000}]
out["too_long"] = error_of(lambda: client.chat.completions.create(model=model, messages=long, max_tokens=4))
out["too_long_streamed"] = error_of(lambda: client.chat.completions.create(model=model, messages=long, max_tokens=4,
                                                                           stream=True))
out["no_key"] = error_of(lambda: openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list())

request = urllib.request.Request(base_url + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
try:
    urllib.request.urlopen(request)
    out["bad_json"] = None
except urllib.error.HTTPError as e:
    out["bad_json"] = {"status": e.code, "body": json.loads(e.read())}

print(json.dumps(out))
