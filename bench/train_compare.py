"""`gpt train` against PyTorch training the same model, same machine, same threads, in
alternation.

    /tmp/ref/bin/python bench/train_compare.py [--data FILE] [--threads 2] [--rounds 3]
        [--steps 12] [--batch 16] [--block 256] [--layers 4] [--heads 6] [--width 192]
        [--arch gpt2|llama] [--kv-heads N]

The model is GPT-2's architecture at the given size (learned positions, pre-LayerNorm,
tanh GELU, biases, tied LM head, no dropout), or with --arch llama Llama's (rotary
positions with theta 10000 in the rotate-half layout, RMSNorm with eps 1e-5, SwiGLU of
8/3 × the width rounded up to 32s, --kv-heads key/value heads, no biases, tied head: what
`gpt train --arch llama` builds), with the default model's tokenizer (vocabulary 2048).
PyTorch trains it with a nanoGPT-style loop: its module written the same way
(`F.scaled_dot_product_attention(is_causal=True)`, the fused kernel PyTorch picks on the
CPU; `nn.RMSNorm`), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices, `fused=True`
where the build has it), gradient clipping at 1.0, random batches from the tokenized
text, `torch.set_num_threads(--threads)`, eager mode (nanoGPT's `torch.compile` needs a
C++ toolchain at run time and minutes of compilation; pass --compile to try it).
`gpt train` (build it first: cargo build --release --bin gpt) runs with
`RAYON_NUM_THREADS=--threads` and reports its own average.

Each side runs in its own process; tokens/s is the mean over the steps after the first,
peak RSS is the process's high-water mark (`ru_maxrss`), which for PyTorch includes the
~300 MB that importing torch costs (its RSS after the import is printed too). Medians over
rounds, and the ratio ours / PyTorch.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOKENIZER = os.path.join(ROOT, "crates", "cli", "models", "default", "tokenizer.json")


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/tmp/shakespeare.txt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    return p


def torch_child(a):
    """Trains in this process and prints `tokens_per_s rss_after_import_mb`."""
    import time

    def rss_mb():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    after_import = rss_mb()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    tok = Tokenizer.from_file(TOKENIZER)
    text = open(a.data, encoding="utf-8").read()
    ids = [i for e in tok.encode_batch(text.split("\n\n")) for i in e.ids]
    data = torch.tensor(ids, dtype=torch.long)
    n_val = len(data) // 10
    train = data[: len(data) - n_val]
    V, C, T = tok.get_vocab_size(), a.width, a.block

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T_, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            heads = lambda t: t.view(B, T_, a.heads, C // a.heads).transpose(1, 2)
            y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T_, C))
            h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
            return x + self.mlp_proj(h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1])
            x = self.wte(idx) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    H = a.heads
    KV = a.kv_heads or H
    D = C // H
    F_ = (8 * C + 2) // 3
    F_ = (F_ + 31) // 32 * 32
    half = D // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, half, dtype=torch.float32) * 2 / D))
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], -1)  # [T, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)

    def rope(t):  # [B, h, T, D], rotate-half (Llama's layout in transformers)
        t1, t2 = t[..., :half], t[..., half:]
        n = t.shape[2]
        return t * cos[:n] + torch.cat([-t2, t1], -1) * sin[:n]

    class LlamaBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = nn.RMSNorm(C, eps=1e-5)
            self.post_attention_layernorm = nn.RMSNorm(C, eps=1e-5)
            self.q_proj = nn.Linear(C, C, bias=False)
            self.k_proj = nn.Linear(C, KV * D, bias=False)
            self.v_proj = nn.Linear(C, KV * D, bias=False)
            self.o_proj = nn.Linear(C, C, bias=False)
            self.gate_proj = nn.Linear(C, F_, bias=False)
            self.up_proj = nn.Linear(C, F_, bias=False)
            self.down_proj = nn.Linear(F_, C, bias=False)

        def forward(self, x):
            B, T_, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q_proj(h).view(B, T_, H, D).transpose(1, 2)
            k = self.k_proj(h).view(B, T_, KV, D).transpose(1, 2)
            v = self.v_proj(h).view(B, T_, KV, D).transpose(1, 2)
            y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                               enable_gqa=KV != H)
            x = x + self.o_proj(y.transpose(1, 2).contiguous().view(B, T_, C))
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.h = nn.ModuleList(LlamaBlock() for _ in range(a.layers))
            self.norm = nn.RMSNorm(C, eps=1e-5)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets):
            x = self.wte(idx)
            for b in self.h:
                x = b(x)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    model = GPT() if a.arch == "gpt2" else Llama()
    # nanoGPT's initialisation (and `gpt train`'s): N(0, 0.02), residual projections
    # scaled by 1/sqrt(2·layers), positions N(0, 0.01) as GPT-2, biases 0.
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif ".ln_" in name or name.startswith("ln_f") or "norm" in name:
            nn.init.ones_(p)
        elif name.endswith(("attn_proj.weight", "mlp_proj.weight", "o_proj.weight",
                            "down_proj.weight")):
            nn.init.normal_(p, std=0.02 / (2 * a.layers) ** 0.5)
        elif name == "wpe.weight":
            nn.init.normal_(p, std=0.01)
        else:
            nn.init.normal_(p, std=0.02)
    if a.compile:
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    try:
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1337)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        ix = torch.randint(len(train) - T - 1, (a.batch,), generator=gen)
        x = torch.stack([train[i : i + T] for i in ix])
        y = torch.stack([train[i + 1 : i + 1 + T] for i in ix])
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    tok_s = a.batch * T * (len(times) - 1) / sum(times[1:])
    print(f"{tok_s:.1f} {after_import:.1f} {loss.item():.4f}")


def measure(cmd, env=None):
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        log.seek(0)
        out = log.read()
    if status != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out}")
    return out, usage.ru_maxrss / 1024


def main():
    a = args_parser().parse_args()
    if a.torch_child:
        return torch_child(a)
    gpt = os.path.join(ROOT, "target", "release", "gpt")
    shape = ["--batch", str(a.batch), "--block", str(a.block), "--layers", str(a.layers),
             "--heads", str(a.heads), "--width", str(a.width), "--steps", str(a.steps),
             "--threads", str(a.threads), "--data", a.data, "--arch", a.arch]
    if a.kv_heads:
        shape += ["--kv-heads", str(a.kv_heads)]
    arch = ["--arch", a.arch] + (["--n-kv-head", str(a.kv_heads)] if a.kv_heads else [])
    torch_cmd = [sys.executable, os.path.abspath(__file__), "--torch-child", *shape]
    if a.compile:
        torch_cmd.append("--compile")
    ours, theirs = {"tok": [], "rss": []}, {"tok": [], "rss": [], "base": []}
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as out_dir:
            out, rss = measure([gpt, "train", "--data", a.data, "--out", out_dir,
                                "--tokenizer", TOKENIZER, "--n-layer", str(a.layers),
                                "--n-head", str(a.heads), "--n-embd", str(a.width),
                                "--block-size", str(a.block), "--batch-size", str(a.batch),
                                "--steps", str(a.steps), "--eval-every", str(a.steps),
                                "--eval-batches", "1", "--dropout", "0", "--quiet", *arch], env)
        m = re.search(r"steps: (\d+) tokens/s", out)
        if not m:
            sys.exit(f"no throughput line in gpt's output:\n{out}")
        ours["tok"].append(float(m.group(1)))
        ours["rss"].append(rss)
        out, rss = measure(torch_cmd)
        tok, base, loss = out.strip().splitlines()[-1].split()
        theirs["tok"].append(float(tok))
        theirs["rss"].append(rss)
        theirs["base"].append(float(base))
        print(f"round {r + 1}: gpt {ours['tok'][-1]:.0f} tok/s, {ours['rss'][-1]:.0f} MB; "
              f"PyTorch {float(tok):.0f} tok/s, {rss:.0f} MB (after import {float(base):.0f} MB), "
              f"loss {loss}", flush=True)
    med = statistics.median
    print(f"\n{a.arch}: {a.batch} x {a.block} tokens, {a.layers} layers, width {a.width}, {a.heads} heads, "
          f"{a.threads} threads, {a.steps} steps, medians of {a.rounds} rounds")
    print("| | gpt train | PyTorch | ours / theirs |\n|---|---|---|---|")
    print(f"| tokens/s | {med(ours['tok']):.0f} | {med(theirs['tok']):.0f} | "
          f"{med(ours['tok']) / med(theirs['tok']):.2f}x |")
    print(f"| peak RSS (MB) | {med(ours['rss']):.0f} | {med(theirs['rss']):.0f} | "
          f"{med(ours['rss']) / med(theirs['rss']):.2f}x |")
    print(f"| RSS after `import torch` (MB) | | {med(theirs['base']):.0f} | |")


if __name__ == "__main__":
    main()
