"""Time to first token of a chat replayed turn by turn, with `gpt serve`'s prompt cache and
without it (`--cache-mem 0`), in alternation, on Qwen3-0.6B's body.

    cargo build --release --bin gpt
    /tmp/ref/bin/python bench/prompt_cache.py [--turns 10] [--rounds 2] [--quantize q8_0]

Each turn sends the whole history (system prompt, every earlier question and reply, the new
question: about 100 tokens per question) to `/v1/chat/completions`, streamed, greedy, 16 new
tokens, and times the first token at the client. Without the cache every turn prefills its
whole prompt; with it, only what the previous turn did not already compute. The replies must
be the same in both modes (the script exits 1 otherwise).

The model: Qwen3-0.6B's geometry (28 layers, width 1024, 16 heads over 8, head 128, MLP
3072; bench/checkpoints.py) with random weights, but the built-in model's 2048-token
vocabulary and tokenizer, so that replies are text that tokenizes back to what was
generated (no Qwen tokenizer can be downloaded here). The vocabulary changes only the head's
product, the same in both modes.
"""
import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser()
p.add_argument("--gpt", default=os.path.join(ROOT, "target/release/gpt"))
p.add_argument("--turns", type=int, default=10)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--quantize", default="q8_0", help="'' for the f32 weights")
p.add_argument("--dir", default="/tmp/qwen3-0.6b-v2048")
p.add_argument("--shared", type=int, default=0,
               help="instead: this many concurrent clients sharing one long system prompt")
args = p.parse_args()

QUESTIONS = [
    "Tell me of the king who rode at dawn across the fields of France with all his lords",
    "Now speak of the sea, the ships that sailed from Milford Haven and the storm that came",
    "What did the old duke say when his daughters turned him out into the night and rain",
    "Describe the garden where the lovers met beneath the orchard trees by the light of",
    "How did the captain answer when the herald came to ask for ransom before the battle",
    "Remember the letter the steward found, and how he read it aloud in the box tree walk",
    "Who stood upon the walls of the castle when the forest seemed to move towards it",
    "What song did the fool sing on the heath, and what did the madman answer to him then",
    "Tell of the ring she gave him and the oath he swore to keep it till his dying day",
    "How ended the quarrel in the public square between the houses of the two old families",
    "What did the ghost command upon the platform of the castle in the cold of the night",
    "Speak again of the crown, and of the weight of it upon the head of one who wears it",
]


def checkpoint(path):
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(
            "qwen3", vocab_size=2048, hidden_size=1024, intermediate_size=3072,
            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
        shutil.copy(os.path.join(ROOT, "crates/cli/models/default/tokenizer.json"), path)
    return path


def start(model, cache_mem):
    cmd = [args.gpt, "--threads", str(args.threads), "--model", model]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    cmd += ["serve", "--port", "0", "--cache-mem", str(cache_mem)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("listening on "):
            return proc, line.split()[-1].removeprefix("http://")
    proc.kill()
    sys.exit("the server did not start")


def turn(addr, messages):
    """(reply, seconds to the first token, cached prompt tokens, prompt tokens)"""
    host, port = addr.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"HTTP {resp.status}: {resp.read()[:300]}")
    first, text, usage = None, "", None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices", []):
            delta = c.get("delta", {})
            if first is None and (delta.get("content") or c.get("finish_reason")):
                first = time.perf_counter() - t0
            text += delta.get("content") or ""
    conn.close()
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return text, first, cached, usage["prompt_tokens"]


def replay(model, cache_mem):
    proc, addr = start(model, cache_mem)
    try:
        messages = [{"role": "system", "content": "You are a player in a company of actors."
                     " Answer every question in the voice of the play it comes from."}]
        out = []
        for i in range(args.turns):
            messages.append({"role": "user", "content": " ".join(
                QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(6))})
            reply, ttft, cached, prompt = turn(addr, messages)
            messages.append({"role": "assistant", "content": reply})
            out.append((reply, ttft, cached, prompt))
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def shared(model, cache_mem):
    """`args.shared` clients at once, each with the same system prompt of about 1,000
    tokens and a question of its own: (replies, wall seconds, median and largest time to
    the first token, cached tokens in all)."""
    import concurrent.futures
    proc, addr = start(model, cache_mem)
    try:
        system = " ".join(QUESTIONS * 6)  # about 1,000 tokens
        def ask(i):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}]
            return turn(addr, messages)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.shared) as pool:
            out = list(pool.map(ask, range(args.shared)))
        wall = time.perf_counter() - t0
        ttfts = sorted(o[1] for o in out)
        return ([o[0] for o in out], wall, statistics.median(ttfts), ttfts[-1],
                sum(o[2] for o in out), out[0][3])
    finally:
        proc.terminate()
        proc.wait(timeout=60)


model = checkpoint(args.dir)
if args.shared:
    res = {}
    for r in range(args.rounds):
        for mode in (["none", "cache"] if r % 2 == 0 else ["cache", "none"]):
            res.setdefault(mode, []).append(shared(model, 1024 if mode == "cache" else 0))
            replies, wall, p50, worst, cached, prompt = res[mode][-1]
            print(f"round {r + 1} {mode:5}: {args.shared} clients, prompts of {prompt} tokens, "
                  f"{cached} cached in all; {wall:.1f} s, first token p50 {p50:.2f} s, "
                  f"last {worst:.2f} s", flush=True)
    ok = all(a[0] == b[0] for a in res["cache"] for b in res["none"])
    print(f"\nreplies identical with and without the cache: {ok}")
    med = lambda m, k: statistics.median(x[k] for x in res[m])  # noqa: E731
    print("| | wall s | first token p50 s | last first token s |")
    print("|---|---|---|---|")
    for m in ("none", "cache"):
        print(f"| {m} | {med(m, 1):.1f} | {med(m, 2):.2f} | {med(m, 3):.2f} |")
    print(f"| ratio | {med('none', 1) / med('cache', 1):.1f}x | "
          f"{med('none', 2) / med('cache', 2):.1f}x | {med('none', 3) / med('cache', 3):.1f}x |")
    sys.exit(0 if ok else 1)

runs = {"cache": [], "none": []}
for r in range(args.rounds):
    for mode in (["none", "cache"] if r % 2 == 0 else ["cache", "none"]):
        runs[mode].append(replay(model, 1024 if mode == "cache" else 0))
        last = runs[mode][-1][-1]
        print(f"round {r + 1} {mode:5}: last turn {last[3]} prompt tokens, {last[2]} cached, "
              f"first token {last[1]:.3f} s", flush=True)

ok = all(t[0] == u[0] for a in runs["cache"] for b in runs["none"] for t, u in zip(a, b))
print(f"\nreplies identical with and without the cache: {ok}")
print("turn  prompt  cached   TTFT none (s)  TTFT cache (s)  ratio")
for i in range(args.turns):
    none = statistics.median(run[i][1] for run in runs["none"])
    cache = statistics.median(run[i][1] for run in runs["cache"])
    prompt, cached = runs["cache"][0][i][3], runs["cache"][0][i][2]
    print(f"{i + 1:4}  {prompt:6}  {cached:6}  {none:13.3f}  {cache:14.3f}  {none / cache:5.1f}x")
sys.exit(0 if ok else 1)
