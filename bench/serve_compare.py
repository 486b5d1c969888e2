"""`gpt serve` against llama.cpp's `llama-server` on the same GGUF file, same threads, the
same client (the official `openai` one, bench/serve_load.py's requests), in alternation:
1, 4, 16 and 64 concurrent clients, each sending requests one after another. Reports each
server's generated tokens/s and median latency per level (medians over the rounds), and the
ratios gpt / llama-server.

    cargo build --release --bin gpt
    python bench/serve_compare.py --model crates/cli/models/default/model.q5_0.gguf \\
        [--llama-server /tmp/lcp/build/bin/llama-server] [--rounds 2] [--structured]

Both servers decode at most --max-batch sequences together (`--max-batch` for gpt, `-np`
slots for llama-server, each slot with the model's whole context) and queue the rest; both
sample (temperature 0.8, a seed per request) and stream. `--structured` adds a third
column: `gpt serve` with every request constrained by a JSON schema (`response_format`),
to show what structured output costs in throughput.

llama.cpp: the tree vendored by the `llama-cpp-python` source package (see
docs/PERFORMANCE.md), built with CMake from PyPI:

    cmake -S .../vendor/llama.cpp -B /tmp/lcp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build /tmp/lcp/build --target llama-server -j 2
"""
import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import pct, start_server  # noqa: E402  (bench/serve_load.py)

# A string longer than any reply: structured replies run to max_tokens as plain ones do, so
# that both columns count the same work per request.
SCHEMA = {"type": "object", "properties": {"speech": {"type": "string", "minLength": 4096}},
          "required": ["speech"], "additionalProperties": False}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(args):
    port = free_port()
    cmd = [args.llama_server, "-m", args.model, "-t", str(args.threads), "-tb",
           str(args.threads), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(args.max_batch), "-c", str(args.max_batch * args.ctx), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except Exception:
            time.sleep(0.5)
    proc.kill()
    sys.exit("llama-server did not start")


async def one(client, model, i, args, stats, structured):
    t0 = time.perf_counter()
    extra = {}
    if structured:
        extra["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": SCHEMA}}
    try:
        stream = await client.completions.create(
            model=model, prompt=f"ROMEO {i}:", max_tokens=args.max_tokens, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True},
            timeout=args.timeout, extra_body=extra)
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert tokens > 0, "no usage in the stream"
        stats["latency"].append(time.perf_counter() - t0)
        stats["tokens"] += tokens
    except Exception as e:  # every failure is reported
        stats["errors"].append(repr(e))


async def phase(base, model, clients, args, structured=False):
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stats = {"latency": [], "tokens": 0, "errors": []}

    async def loop(c):
        for r in range(args.requests):
            await one(client, model, c * 1000 + r, args, stats, structured)

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(loop(c) for c in range(clients))),
                           timeout=args.phase_timeout)
    wall = time.perf_counter() - t0
    await client.close()
    return stats["tokens"] / wall, pct(stats["latency"], 50), stats["errors"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpt", default="target/release/gpt")
    p.add_argument("--llama-server", default="/tmp/lcp/build/bin/llama-server")
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--ctx", type=int, default=256, help="context per sequence")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--structured", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--phase-timeout", type=float, default=3600)
    args = p.parse_args()
    args.quantize = None
    args.max_queue = 256
    gpt_proc, gpt_base = start_server(args)
    llama_proc, llama_base = start_llama(args)
    failed = False
    try:
        models = {b: openai.OpenAI(base_url=b + "/v1", api_key="x").models.list().data[0].id
                  for b in (gpt_base, llama_base)}
        levels = [int(c) for c in args.clients.split(",")]
        runs = {}  # (name, clients) -> [(tokens/s, p50)]
        for r in range(args.rounds):
            for clients in levels:
                order = [("gpt", gpt_base, False), ("llama-server", llama_base, False)]
                if args.structured:
                    order.append(("gpt structured", gpt_base, True))
                if (r + levels.index(clients)) % 2:
                    order.reverse()
                for name, base, structured in order:
                    rate, p50, errors = asyncio.run(
                        phase(base, models[base], clients, args, structured))
                    runs.setdefault((name, clients), []).append((rate, p50, len(errors)))
                    print(f"round {r + 1}, {clients:2} clients, {name:14}: {rate:7.1f} tokens/s,"
                          f" p50 {p50:.3f} s, {len(errors)} failed", flush=True)
                    if errors:
                        # A peer's failures are reported, ours fail the run.
                        failed = failed or name.startswith("gpt")
                        print(f"{name} errors:", errors[:3], file=sys.stderr)
        med = lambda name, c, k: statistics.median(x[k] for x in runs[(name, c)])  # noqa: E731
        print(f"\n{args.model}: {args.threads} threads, max batch {args.max_batch}, "
              f"{args.max_tokens} tokens per request, {args.requests} requests per client, "
              f"{args.rounds} rounds alternating, medians")
        head = ("| clients | gpt tok/s | llama-server tok/s | ratio | gpt p50 s | llama-server p50 s"
                " | failed requests gpt / llama-server |")
        if args.structured:
            head += " gpt structured tok/s | structured / plain |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for c in levels:
            g, l = med("gpt", c, 0), med("llama-server", c, 0)
            fails = lambda n: sum(x[2] for x in runs[(n, c)])  # noqa: E731
            row = (f"| {c} | {g:.1f} | {l:.1f} | **{g / l:.2f}** | {med('gpt', c, 1):.3f} | "
                   f"{med('llama-server', c, 1):.3f} | {fails('gpt')} / {fails('llama-server')} |")
            if args.structured:
                s = med("gpt structured", c, 0)
                row += f" {s:.1f} | {s / g:.2f} |"
            print(row)
    finally:
        for proc in (gpt_proc, llama_proc):
            proc.terminate()
            proc.wait(timeout=60)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
