"""A bounded load test of `gpt serve` on the loopback, with the official `openai` client.

Starts `gpt serve --port 0` itself, then for each concurrency level runs that many clients,
each sending a fixed number of completion requests one after another (every request has a
timeout; nothing loops unbounded). Reports aggregate generated tokens/s, the speed-up over
one client, p50/p99 latency and time to first token, and counts 429s (expected past
--max-queue) and anything else (a failure: exit 1). Every response is checked for shape.

    pip install -r crates/cli/tests/openai/requirements.txt
    cargo build --release
    python bench/serve_load.py --model /path/to/model --clients 1,16,64 --requests 4
"""

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import openai


def start_server(args):
    cmd = [args.gpt, "--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    cmd += ["serve", "--port", "0", "--max-batch", str(args.max_batch),
            "--max-queue", str(args.max_queue)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("listening on "):
            return proc, line.split()[-1]
    proc.kill()
    sys.exit("the server did not start")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def one_request(client, model, i, args, stats):
    t0 = time.perf_counter()
    first = None
    tokens = 0
    try:
        if args.no_stream:
            r = await client.completions.create(
                model=model, prompt=f"ROMEO {i}:", max_tokens=args.max_tokens,
                temperature=0.8, seed=i, timeout=args.timeout)
            assert isinstance(r.choices[0].text, str)
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
            stats["latency"].append(time.perf_counter() - t0)
            stats["ttft"].append(float("nan"))
            stats["tokens"] += r.usage.completion_tokens
            return
        stream = await client.completions.create(
            model=model, prompt=f"ROMEO {i}:", max_tokens=args.max_tokens,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            timeout=args.timeout)
        text = []
        async for chunk in stream:
            for ch in chunk.choices:
                assert isinstance(ch.text, str)
                # The first token's chunk (its text may be held back: half a character).
                if first is None:
                    first = time.perf_counter() - t0
                text.append(ch.text)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
                assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + tokens
        assert tokens > 0, "no usage in the stream"
        stats["latency"].append(time.perf_counter() - t0)
        stats["ttft"].append(first if first is not None else float("nan"))
        stats["tokens"] += tokens
    except openai.RateLimitError:
        stats["429"] += 1
    except Exception as e:  # anything else is a failure
        stats["errors"].append(repr(e))


async def client_loop(client, model, cid, args, stats):
    for r in range(args.requests):
        await one_request(client, model, cid * 1000 + r, args, stats)


async def phase(base, model, clients, args):
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stats = {"latency": [], "ttft": [], "tokens": 0, "429": 0, "errors": []}
    t0 = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(client_loop(client, model, c, args, stats) for c in range(clients))),
        timeout=args.phase_timeout)
    wall = time.perf_counter() - t0
    await client.close()
    return stats, wall


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpt", default="target/release/gpt")
    p.add_argument("--model", default=None, help="default: the built-in model")
    p.add_argument("--quantize", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-stream", action="store_true",
                   help="whole responses (no first-token times; less client work per token)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    p.add_argument("--phase-timeout", type=float, default=1800)
    args = p.parse_args()
    proc, base = start_server(args)
    failed = False
    try:
        model = openai.OpenAI(base_url=base + "/v1", api_key="unused").models.list().data[0].id
        print(f"model {model}, max batch {args.max_batch}, queue {args.max_queue}, "
              f"{args.threads} threads, {args.max_tokens} tokens per request, "
              f"{args.requests} requests per client")
        print("| clients | requests ok | 429 | other errors | tokens/s | × one client "
              "| p50 latency s | p99 latency s | p50 first token s | p99 first token s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        base_rate = None
        for clients in [int(c) for c in args.clients.split(",")]:
            stats, wall = asyncio.run(phase(base, model, clients, args))
            rate = stats["tokens"] / wall
            base_rate = base_rate or rate
            ttft = [t for t in stats["ttft"] if t == t]
            print(f"| {clients} | {len(stats['latency'])} | {stats['429']} | "
                  f"{len(stats['errors'])} | {rate:.1f} | {rate / base_rate:.2f} | "
                  f"{pct(stats['latency'], 50):.3f} | {pct(stats['latency'], 99):.3f} | "
                  f"{pct(ttft, 50):.3f} | {pct(ttft, 99):.3f} |", flush=True)
            if stats["errors"]:
                failed = True
                print("errors:", stats["errors"][:5], file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
