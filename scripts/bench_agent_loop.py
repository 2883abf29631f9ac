#!/usr/bin/env python3
"""An agent loop as a benchmark: a replay of a coding agent at work against `perch serve` and
mlx_lm's server, one after the other in the same run, through the official OpenAI and Anthropic SDKs.

Sub-agents share a long system prompt and the tools; each runs turns that append the model's
answer and a tool result to its conversation (a file's contents, a command's output), as agent
clients do, all sub-agents at once. Every request streams, so its time to first token is the
arrival of the first chunk with a choice (OpenAI; `stream_options.include_usage`) or of
`message_start` (Anthropic), which Perch sends once the first token exists. Reported per replay:
the prompt tokens
served from the prefix cache (all requests, those after each sub-agent's first, and of the tokens
each sub-agent's previous request held: what a prefix cache can give at most), the time to first
token per turn (median over the sub-agents) and the total time.

    python scripts/bench_agent_loop.py --model DIR [--perch target/release/perch]
        [--python PY_WITH_MLX_LM] [--subagents 3] [--turns 6] [--max-tokens 32]
        [--servers perch,perch-anthropic,mlx_lm] [--no-tools] [--json] [--start-delay SECONDS]
        [--server-log PREFIX]

The replays (`--servers`, in the order given):
- `perch`: `perch serve` through the `openai` SDK's chat completions, each sub-agent's requests
  carrying its own `prompt_cache_key`;
- `perch-anthropic`: `perch serve` through the `anthropic` SDK's Messages API, with Claude
  Code's breakpoints: `cache_control` on the system prompt and on the last message's last block;
- `mlx_lm`: `mlx_lm server` through the `openai` SDK (it has no Messages API and no cache keys).

With `--json`, one JSON object a replay, each as it ends.

`--python` runs `python -m mlx_lm server` (default: this interpreter); every server serves the
model directory given (an MLX model: safetensors and config). Needs `openai` (and `anthropic` for
`perch-anthropic`) in this interpreter.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import openai

RULES = [
    "Read a file before you change it, and keep changes small and reviewable.",
    "Run the tests after every change and report failures with their output.",
    "Prefer the project's existing libraries over new dependencies.",
    "Never commit secrets, credentials or large generated files.",
    "Explain what you did in one short paragraph when the task is done.",
]


def system_prompt(sections):
    return "You are a coding agent working in a Rust repository.\n" + "\n".join(
        f"{i + 1}. {rule} (Guideline {i + 1} of the team's handbook, section {j}.)"
        for j in range(sections) for i, rule in enumerate(RULES))


def tool(name, description, **params):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": t, "description": p} for p, t in params.items()},
        "required": list(params)}}}


TOOLS = [
    tool("read_file", "Read a file of the repository", path="string"),
    tool("write_file", "Write a file of the repository", path="string", content="string"),
    tool("run_command", "Run a shell command in the repository", command="string"),
    tool("search", "Search the repository for a pattern", pattern="string"),
]


def tool_result(agent, turn):
    """What a tool gave back: some lines of a file, different for every sub-agent and turn."""
    lines = [f"    let value_{agent}_{turn}_{k} = compute({k}, \"crates/engine/src/part_{agent}.rs\");"
             for k in range(12)]
    return f"Output of read_file for turn {turn}:\nfn step_{agent}_{turn}() {{\n" + "\n".join(lines) + "\n}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base, process, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not answer within the timeout")


def start(server, args):
    port = free_port()
    if server.startswith("perch"):
        command = [args.perch, "serve", "--model", args.model, "--port", str(port)]
    else:
        command = [args.python, "-m", "mlx_lm", "server", "--model", args.model, "--port", str(port)]
    log = open(f"{args.server_log}-{server}.log", "w") if args.server_log else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process)
    except Exception:
        process.kill()
        raise
    time.sleep(args.start_delay)
    return process, base


def task(agent):
    return f"Sub-agent {agent}: the build fails in crates/engine/src/part_{agent}.rs. Find out why and fix it."


def run_agent(send, agent, args, out):
    """One sub-agent's turns through `send` (`openai_turn` or `anthropic_turn`): each turn's
    answer and a tool result join its conversation."""
    messages = [{"role": "user", "content": task(agent)}]
    for turn in range(args.turns):
        start = time.perf_counter()
        first, text, counts = send(messages, agent)
        out.append({"agent": agent, "turn": turn, "ttft_s": first, "total_s": time.perf_counter() - start,
                    **counts})
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": tool_result(agent, turn)})


def openai_turn(client, model, system, args, server):
    """A turn through chat completions: (TTFT, the answer's text, the usage's counts)."""
    tools = {} if args.no_tools else {"tools": TOOLS}

    def send(messages, agent):
        # Perch keeps each sub-agent's prompt under its key (mlx_lm's server has no such field).
        key = {"extra_body": {"prompt_cache_key": f"sub-agent-{agent}"}} if server == "perch" else {}
        start = time.perf_counter()
        first, text, usage = None, [], None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, *messages],
            max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **tools, **key)
        for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - start
            for choice in chunk.choices:
                if choice.delta.content:
                    text.append(choice.delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None)
        return first, "".join(text), {
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) or 0,
            "completion_tokens": usage.completion_tokens if usage else None}
    return send


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def anthropic_turn(client, model, system, args):
    """A turn through the Messages API, with breakpoints where Claude Code puts them: on the
    system prompt and on the last block of the conversation."""
    ephemeral = {"type": "ephemeral"}
    tools = {} if args.no_tools else {"tools": ANTHROPIC_TOOLS}

    def send(messages, agent):
        # An assistant turn must not be empty in the Messages API. (Both replays keep only the
        # answer's text: with tools on, a call the model makes is not sent back.)
        marked = [{**m, "content": m["content"] or "(no text)"} for m in messages[:-1]]
        marked.append({"role": "user", "content": [
            {"type": "text", "text": messages[-1]["content"], "cache_control": ephemeral}]})
        start = time.perf_counter()
        first, text, usage = None, [], {}
        stream = client.messages.create(
            model=model, system=[{"type": "text", "text": system, "cache_control": ephemeral}],
            messages=marked, max_tokens=args.max_tokens, stream=True, extra_body={"temperature": 0},
            **tools)
        for event in stream:
            if event.type == "message_start":
                first = time.perf_counter() - start
                u = event.message.usage
                usage = {"input": u.input_tokens, "read": u.cache_read_input_tokens or 0,
                         "created": u.cache_creation_input_tokens or 0}
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
            elif event.type == "message_delta":
                # The final counts: the blocks a request's breakpoints keep are known only once
                # its prompt is in the cache, after `message_start`.
                u = event.usage
                usage["output"] = u.output_tokens
                for key, field in [("input", "input_tokens"), ("read", "cache_read_input_tokens"),
                                   ("created", "cache_creation_input_tokens")]:
                    if getattr(u, field, None) is not None:
                        usage[key] = getattr(u, field)
        # Anthropic's input_tokens leave out the tokens read from or written to the cache.
        return first, "".join(text), {
            "prompt_tokens": usage["input"] + usage["read"] + usage["created"],
            "cached_tokens": usage["read"], "cache_creation_tokens": usage["created"],
            "completion_tokens": usage.get("output")}
    return send


def replay(server, args):
    process, base = start(server, args)
    try:
        system = system_prompt(args.sections)
        if server == "perch-anthropic":
            import anthropic
            client = anthropic.Anthropic(base_url=base, api_key="bench", max_retries=0, timeout=3600)
            send = anthropic_turn(client, args.model, system, args)
        else:
            client = openai.OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=3600)
            send = openai_turn(client, args.model, system, args, server)
        turns = []
        began = time.perf_counter()
        threads = [threading.Thread(target=run_agent, args=(send, k, args, turns))
                   for k in range(args.subagents)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        total = time.perf_counter() - began
    finally:
        process.terminate()
        process.wait(timeout=60)
    if len(turns) != args.subagents * args.turns:
        raise RuntimeError(f"{server}: {len(turns)} of {args.subagents * args.turns} requests answered")
    later = [t for t in turns if t["turn"] > 0]
    share = lambda ts: sum(t["cached_tokens"] for t in ts) / max(1, sum(t["prompt_tokens"] for t in ts))
    # Of the tokens the sub-agent's previous request held (its prompt and answer), those read from
    # the cache: what a prefix cache can give at most, whatever the turn adds.
    before = {(t["agent"], t["turn"]): t["prompt_tokens"] + t["completion_tokens"] for t in turns}
    held = sum(before[(t["agent"], t["turn"] - 1)] for t in later)
    per_turn = [statistics.median(t["ttft_s"] for t in turns if t["turn"] == k) for k in range(args.turns)]
    return {"server": server, "requests": len(turns), "total_s": total,
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "cached_share": share(turns), "cached_share_after_first": share(later),
            "cached_of_previous": sum(t["cached_tokens"] for t in later) / max(1, held),
            "ttft_per_turn_s": per_turn, "turns": turns}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--perch", default="target/release/perch")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--subagents", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sections", type=int, default=12, help="system prompt length: sections of 5 rules")
    parser.add_argument("--servers", default="perch,perch-anthropic,mlx_lm",
                        help="replays in order: perch (OpenAI SDK), perch-anthropic (Anthropic SDK), mlx_lm")
    parser.add_argument("--no-tools", action="store_true",
                        help="send no tool definitions (for a model whose chat template has none)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--start-delay", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long after a server answers before the replay starts")
    parser.add_argument("--server-log", metavar="PREFIX",
                        help="each replay's server output to PREFIX-REPLAY.log (PREFIX-perch.log, ...)")
    args = parser.parse_args()
    args.model = os.path.abspath(args.model)
    unknown = set(args.servers.split(",")) - {"perch", "perch-anthropic", "mlx_lm"}
    if unknown:
        parser.error(f"unknown servers: {', '.join(sorted(unknown))} (perch, perch-anthropic, mlx_lm)")
    if not args.json:
        tools = "no tools" if args.no_tools else f"{len(TOOLS)} tools"
        print(f"{args.subagents} sub-agents x {args.turns} turns, {args.max_tokens} tokens an answer, {tools}")
        print("| server | total | prompt tokens | from the cache (all / after each first) "
              "| of the previous request's tokens | TTFT per turn (median) |")
        print("|---|---|---|---|---|---|", flush=True)
    # Each server's line as soon as its replay ends (a slow one does not hide the others').
    for server in args.servers.split(","):
        r = replay(server, args)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        ttfts = " / ".join(f"{1000 * t:.0f}" for t in r["ttft_per_turn_s"])
        print(f"| {r['server']} | {r['total_s']:.1f} s | {r['prompt_tokens']} | "
              f"{100 * r['cached_share']:.1f}% / {100 * r['cached_share_after_first']:.1f}% | "
              f"{100 * r['cached_of_previous']:.1f}% | {ttfts} ms |",
              flush=True)


if __name__ == "__main__":
    main()
