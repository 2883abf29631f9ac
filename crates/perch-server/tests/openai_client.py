"""The official OpenAI Python SDK against `perch serve`: prints one JSON object of what it saw.

    python openai_client.py BASE_URL API_KEY MODEL SYSTEM_PROMPT COMPLETION_PROMPT
"""
import json
import sys
import urllib.error
import urllib.request

import openai

base_url, key, model, system, text_prompt = sys.argv[1:6]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
messages = [
    {"role": "developer", "content": system},
    {"role": "user", "content": [{"type": "text", "text": "Name three colors of the rainbow."}]},
]
out = {"sdk": openai.__version__}

out["models"] = [m.id for m in client.models.list().data]

plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
out["plain"] = {
    "content": plain.choices[0].message.content,
    "role": plain.choices[0].message.role,
    "finish_reason": plain.choices[0].finish_reason,
    "usage": plain.usage.model_dump(),
}

pieces, finish, usage, chunks = [], None, None, 0
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
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
stopped = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stop=[stop])
out["stop"] = {"stop": stop, "content": stopped.choices[0].message.content,
               "finish_reason": stopped.choices[0].finish_reason}

# Log-probabilities: each generated token with its three most likely alternatives.
def token_logprobs(entries):
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top": [[t.token, t.logprob] for t in e.top_logprobs]} for e in entries]

scored = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=3)
out["logprobs"] = {"content": scored.choices[0].message.content,
                   "completion_tokens": scored.usage.completion_tokens,
                   "entries": token_logprobs(scored.choices[0].logprobs.content)}
streamed_entries = []
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True):
    for choice in chunk.choices:
        if choice.logprobs is not None:
            streamed_entries += token_logprobs(choice.logprobs.content)
out["logprobs_streamed"] = streamed_entries

# OpenAI's penalties change a greedy answer (the Rust side computes the expected one directly).
penalized = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                           presence_penalty=1.5, frequency_penalty=1.0)
out["penalized"] = penalized.choices[0].message.content

# XTC, mlx_lm's server extension (sent in the body, as its clients do), on a seeded sample.
xtc = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=1.0, seed=5,
                                     extra_body={"xtc_probability": 1.0, "xtc_threshold": 0.05})
out["xtc"] = xtc.choices[0].message.content
# Perch's per-request KV cache options (mlx_lm's generation flags), in extra_body.
bounded = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                         extra_body={"max_kv_size": 8})
out["bounded"] = bounded.choices[0].message.content

# The legacy Completions endpoint: text or token ids, echo, log-probabilities, several prompts.
def completion(**kwargs):
    done = client.completions.create(model=model, max_tokens=4, temperature=0, **kwargs)
    return {"texts": [c.text for c in done.choices], "indexes": [c.index for c in done.choices],
            "finish": [c.finish_reason for c in done.choices], "usage": done.usage.model_dump(),
            "logprobs": [c.logprobs.model_dump() if c.logprobs else None for c in done.choices]}

out["completion"] = completion(prompt=text_prompt)
out["completion_echo"] = completion(prompt=text_prompt, echo=True)
out["completion_logprobs"] = completion(prompt=text_prompt, logprobs=2)
out["completion_echo_logprobs"] = completion(prompt=text_prompt, echo=True, logprobs=1)
out["completion_two"] = completion(prompt=[text_prompt, "The capital of France is"])
ids = sys.argv[6:]
out["completion_ids"] = completion(prompt=[int(i) for i in ids])
pieces, finish = [], None
for chunk in client.completions.create(model=model, prompt=text_prompt, max_tokens=4, temperature=0, stream=True):
    for choice in chunk.choices:
        pieces.append(choice.text)
        finish = choice.finish_reason or finish
out["completion_stream"] = {"text": "".join(pieces), "finish_reason": finish}

# Structured outputs: the SDK's parse() sends the Pydantic model as a strict JSON schema and
# parses the answer back into it; json_object asks for any JSON object.
from pydantic import BaseModel  # noqa: E402 (the openai SDK depends on pydantic)


class Cat(BaseModel):
    name: str
    age: int
    indoor: bool


cat_question = [{"role": "user", "content": "Describe a cat called Tom who is 3 years old."}]
parsed = client.chat.completions.parse(model=model, messages=cat_question, max_tokens=200, temperature=0,
                                       response_format=Cat)
out["parsed"] = {"cat": parsed.choices[0].message.parsed.model_dump(),
                 "finish_reason": parsed.choices[0].finish_reason}
anything = client.chat.completions.create(model=model, messages=cat_question, max_tokens=300, temperature=0,
                                          frequency_penalty=1.0, response_format={"type": "json_object"})
out["json_object"] = {"content": anything.choices[0].message.content,
                      "finish_reason": anything.choices[0].finish_reason}


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
out["bad_penalty"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages,
                                                                    presence_penalty=3))
out["bad_kv"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                               extra_body={"max_kv_size": 64, "kv_bits": 8}))
out["bad_xtc"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages,
                                                                temperature=1.0, extra_body={"xtc_threshold": 0.7}))
out["top_logprobs_alone"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages,
                                                                            top_logprobs=2))
out["no_tool_support"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages, tools=[
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]))
out["bad_schema"] = error_of(lambda: client.chat.completions.create(model=model, messages=messages, response_format={
    "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}))
out["no_key"] = error_of(lambda: openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list())

request = urllib.request.Request(base_url + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
try:
    urllib.request.urlopen(request)
    out["bad_json"] = None
except urllib.error.HTTPError as e:
    out["bad_json"] = {"status": e.code, "body": json.loads(e.read())}

print(json.dumps(out))
