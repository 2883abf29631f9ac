"""A scripted coding agent through the official OpenAI SDK against `perch serve`: a long system
prompt and tool definitions, five turns that append the assistant's answer (text or tool calls) and
a tool result, and a system reminder appended to a late turn, as agent clients do. Prints, per
turn, the prompt tokens and those read from the prefix cache.

    python agent_loop_client.py BASE_URL API_KEY MODEL
"""
import json
import sys

import openai

base_url, key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)

rules = [
    "Read a file before you change it, and keep changes small and reviewable.",
    "Run the tests after every change and report failures with their output.",
    "Prefer the project's existing libraries over new dependencies.",
    "Never commit secrets, credentials or large generated files.",
    "Explain what you did in one short paragraph when the task is done.",
]
system = "You are a coding agent working in a Rust repository.\n" + "\n".join(
    f"{i + 1}. {rule} (Guideline {i + 1} of the team's handbook, section {j}.)"
    for j in range(3) for i, rule in enumerate(rules))


def tool(name, description, **params):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": t, "description": p} for p, t in params.items()},
        "required": list(params)}}}


tools = [
    tool("read_file", "Read a file of the repository", path="string"),
    tool("write_file", "Write a file of the repository", path="string", content="string"),
    tool("run_command", "Run a shell command in the repository", command="string"),
    tool("search", "Search the repository for a pattern", pattern="string"),
]
messages = [{"role": "system", "content": system},
            {"role": "user", "content": "The build fails in crates/engine/src/lib.rs. Find out why and fix it."}]
turns = []
for turn in range(5):
    if turn == 4:
        messages.append({"role": "user", "content": "<system-reminder>The user's todo list changed: "
                         "1. fix the build 2. run the tests.</system-reminder>"})
    reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4,
                                           temperature=0)
    message = reply.choices[0].message
    turns.append({"prompt_tokens": reply.usage.prompt_tokens,
                  "cached_tokens": reply.usage.prompt_tokens_details.cached_tokens,
                  "tool_calls": len(message.tool_calls or [])})
    if message.tool_calls:
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"output of {call.function.name} for turn {turn}: ok"})
    else:
        messages.append({"role": "assistant", "content": message.content})
        messages.append({"role": "user", "content": f"Tool output for turn {turn}: error[E0425]: cannot find "
                         f"value `x{turn}` in this scope. Continue."})
print(json.dumps({"turns": turns}))
