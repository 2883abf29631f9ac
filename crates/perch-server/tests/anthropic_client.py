"""The official Anthropic Python SDK against `perch serve`: prints one JSON object of what it saw.

    python anthropic_client.py BASE_URL API_KEY MODEL SYSTEM_PROMPT
"""
import json
import sys
import urllib.error
import urllib.request

import anthropic

base_url, key, model, system = sys.argv[1:5]
client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
out = {"sdk": anthropic.__version__}
# SDK 2.x no longer has sampling arguments; the API fields still go through `extra_body`.
greedy = {"extra_body": {"temperature": 0}}

def message_of(m):
    return {"id": m.id, "type": m.type, "role": m.role, "model": m.model,
            "content": [b.model_dump(exclude_none=True) for b in m.content], "stop_reason": m.stop_reason,
            "stop_sequence": m.stop_sequence, "usage": m.usage.model_dump()}

out["count"] = client.messages.count_tokens(model=model, system=system, messages=messages).input_tokens
out["plain"] = message_of(client.messages.create(model=model, max_tokens=8, system=system, messages=messages,
                                                 **greedy))
# The system prompt as blocks, and the user's content as blocks: the same conversation.
blocks = client.messages.create(model=model, max_tokens=8, **greedy,
                                system=[{"type": "text", "text": system}],
                                messages=[{"role": "user",
                                           "content": [{"type": "text", "text": messages[0]["content"]}]}])
out["blocks"] = message_of(blocks)

# Streamed through the SDK's helper (which checks the event sequence), and the raw event types.
with client.messages.stream(model=model, max_tokens=8, system=system, messages=messages,
                            **greedy) as stream:
    out["stream_text"] = "".join(stream.text_stream)
    out["stream_final"] = message_of(stream.get_final_message())
out["stream_events"] = [e.type for e in client.messages.create(model=model, max_tokens=4, system=system,
                                                               messages=messages, stream=True, **greedy)]

words = out["plain"]["content"][0]["text"].split()
stop = words[2] if len(words) > 2 else words[-1]
out["stop"] = {"stop": stop, "message": message_of(client.messages.create(
    model=model, max_tokens=8, system=system, messages=messages, stop_sequences=[stop], **greedy))}

# A breakpoint on a system prompt no request sent before: created by the first request, read by
# the second (streamed: the SDK folds `message_delta`'s usage into the final message).
cached_system = [{"type": "text", "text": "Keep this prompt cached. " + system,
                  "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
out["cache_first"] = message_of(client.messages.create(model=model, max_tokens=4, system=cached_system,
                                                       messages=messages, **greedy))
with client.messages.stream(model=model, max_tokens=4, system=cached_system,
                            messages=[{"role": "user", "content": "Name two animals."}], **greedy) as stream:
    out["cache_second"] = message_of(stream.get_final_message())

def error_of(call):
    try:
        call()
    except anthropic.APIStatusError as e:
        return {"status": e.status_code, "body": e.body}
    return None

def raw(body, path="/v1/messages"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, method="POST",
                                     headers={"x-api-key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return {"status": response.status, "body": json.loads(response.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": json.loads(e.read())}

# The wire itself (the SDK drops `ping`): event names in order.
request = urllib.request.Request(base_url + "/v1/messages", method="POST", data=json.dumps(
    {"model": model, "max_tokens": 4, "messages": messages, "stream": True, "temperature": 0}).encode(),
    headers={"x-api-key": key, "Content-Type": "application/json"})
with urllib.request.urlopen(request) as response:
    out["wire_events"] = [line[len(b"event: "):].decode().strip() for line in response
                          if line.startswith(b"event: ")]

out["no_max_tokens"] = raw({"model": model, "messages": messages})
out["bad_json"] = raw(b"{not json")
out["unknown_model"] = error_of(lambda: client.messages.create(model="no-such-model", max_tokens=4,
                                                               messages=messages))
out["too_long"] = error_of(lambda: client.messages.create(model=model, max_tokens=4,
                                                          messages=[{"role": "user", "content": "word " * 10000}]))
out["image"] = error_of(lambda: client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]))
out["hot"] = error_of(lambda: client.messages.create(model=model, max_tokens=4, messages=messages,
                                                       extra_body={"temperature": 1.5}))
out["no_key"] = error_of(lambda: anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
                         .messages.create(model=model, max_tokens=4, messages=messages))
print(json.dumps(out))
