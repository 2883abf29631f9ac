"""Tool calling through the official SDKs against `perch serve` on a model with a tool-capable chat
template; also transformers' rendering of the same conversations, to compare prompts. Prints one
JSON object of what it saw.

    python tools_client.py BASE_URL API_KEY MODEL MODEL_DIR
"""
import json
import sys

import anthropic
import openai
from transformers import AutoTokenizer

base_url, key, model, model_dir = sys.argv[1:5]
client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
claude = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
greedy = {"extra_body": {"temperature": 0}}

weather = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]},
}}
tools = [weather]
system = "You are a helpful assistant with access to tools."
messages = [{"role": "system", "content": system},
            {"role": "user", "content": "What is the weather like in Paris today?"}]
# A later turn: the assistant's call (arguments as OpenAI sends them, a JSON string) and its result.
call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
followup = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
out = {}

hf = AutoTokenizer.from_pretrained(model_dir)
def hf_ids(conversation):
    # transformers wants the arguments as an object, as Perch passes them to the template.
    fixed = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                                 for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in conversation]
    ids = hf.apply_chat_template(fixed, tools=tools, add_generation_prompt=True, tokenize=True)
    # transformers 5 answers a BatchEncoding, 4 a list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
out["hf_prompt_tokens"] = len(hf_ids(messages))
out["hf_followup_tokens"] = len(hf_ids(followup))
out["hf_ids"] = hf_ids(messages)

def openai_message(m):
    return {"content": m.content,
            "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
                           for c in m.tool_calls or []]}

plain = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=60, **greedy)
out["openai"] = {**openai_message(plain.choices[0].message), "finish_reason": plain.choices[0].finish_reason,
                 "prompt_tokens": plain.usage.prompt_tokens}

content, calls, finish = "", {}, None
for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=60,
                                            stream=True, **greedy):
    for choice in chunk.choices:
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = c.id or entry["id"]
            entry["name"] += (c.function.name or "") if c.function else ""
            entry["arguments"] += (c.function.arguments or "") if c.function else ""
        finish = choice.finish_reason or finish
out["openai_stream"] = {"content": content or None, "finish_reason": finish,
                        "tool_calls": [{"id": c["id"], "name": c["name"], "arguments": json.loads(c["arguments"])}
                                       for _, c in sorted(calls.items())]}

second = client.chat.completions.create(model=model, messages=followup, tools=tools, max_tokens=30, **greedy)
out["openai_followup"] = {**openai_message(second.choices[0].message),
                          "prompt_tokens": second.usage.prompt_tokens,
                          "cached_tokens": second.usage.prompt_tokens_details.cached_tokens}
none = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                      max_tokens=8, **greedy)
out["openai_none_prompt_tokens"] = none.usage.prompt_tokens

claude_tools = [{"name": "get_weather", "description": "Get the current weather in a city",
                 "input_schema": weather["function"]["parameters"]}]
reply = claude.messages.create(model=model, max_tokens=60, system=system, tools=claude_tools,
                               messages=messages[1:], **greedy)
out["anthropic"] = {"content": [b.model_dump(exclude_none=True) for b in reply.content],
                    "stop_reason": reply.stop_reason, "input_tokens": reply.usage.input_tokens,
                    "cache_read": reply.usage.cache_read_input_tokens}
with claude.messages.stream(model=model, max_tokens=60, system=system, tools=claude_tools,
                            messages=messages[1:], **greedy) as stream:
    final = stream.get_final_message()
out["anthropic_stream"] = {"content": [b.model_dump(exclude_none=True) for b in final.content],
                           "stop_reason": final.stop_reason}
# The tool result back, Anthropic's way: the assistant's tool_use block, the user's tool_result block.
back = claude.messages.count_tokens(model=model, system=system, tools=claude_tools, messages=[
    messages[1],
    {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                  "content": "18 degrees and sunny"}]},
])
out["anthropic_followup_tokens"] = back.input_tokens
print(json.dumps(out))
