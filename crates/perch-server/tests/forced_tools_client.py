"""Forced tool calls (OpenAI's tool_choice "required" and a named function, Anthropic's "any" and
"tool") through the official SDKs against `perch serve` on the test model with a tool-capable chat
template. Prints one JSON object of what it saw.

    python forced_tools_client.py BASE_URL API_KEY MODEL
"""
import json
import sys

import anthropic
import openai

base_url, key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
claude = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)

city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"], "additionalProperties": False}
zone = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]},
                                         "24h": {"type": "boolean"}},
        "required": ["timezone", "24h"], "additionalProperties": False}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": city}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": zone}}]
messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
out = {}


def calls_of(message):
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
            for c in message.tool_calls or []]


answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                        max_tokens=200, temperature=0)
out["required"] = {"finish_reason": answer.choices[0].finish_reason, "content": answer.choices[0].message.content,
                   "calls": calls_of(answer.choices[0].message)}
answer = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=200, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})
out["named"] = {"finish_reason": answer.choices[0].finish_reason, "calls": calls_of(answer.choices[0].message)}

deltas, finish = [], None
for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                            max_tokens=200, temperature=0, stream=True):
    for choice in chunk.choices:
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            deltas.append({"index": call.index, "name": call.function.name,
                           "arguments": json.loads(call.function.arguments)})
out["streamed"] = {"finish_reason": finish, "calls": deltas}


def error_of(call):
    try:
        call()
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return {"status": e.status_code, "body": e.body}
    return None


out["required_without_tools"] = error_of(lambda: client.chat.completions.create(
    model=model, messages=messages, tool_choice="required", max_tokens=8))
out["unknown_name"] = error_of(lambda: client.chat.completions.create(
    model=model, messages=messages, tools=tools, max_tokens=8,
    tool_choice={"type": "function", "function": {"name": "no_such_tool"}}))

claude_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in tools]
for label, choice in [("any", {"type": "any"}), ("tool", {"type": "tool", "name": "get_weather"})]:
    reply = claude.messages.create(model=model, max_tokens=200, messages=messages, tools=claude_tools,
                                   tool_choice=choice, extra_body={"temperature": 0})
    out["anthropic_" + label] = {"stop_reason": reply.stop_reason,
                                 "blocks": [{"type": b.type, "name": getattr(b, "name", None),
                                             "input": getattr(b, "input", None)} for b in reply.content]}
print(json.dumps(out))
