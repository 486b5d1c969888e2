"""PyTorch references for the gradients of `mha`'s fused training ops: the attention
kernel (`mha::flash::flash_attn_cpu_train`) and LayerNorm, RMSNorm, linear, tanh GELU
and next-token cross-entropy (`gpt_kernels::ops`, `gpt_kernels::act::gelu_tanh`).

Writes crates/mha/tests/fixtures/attention_grads.safetensors and
crates/kernels/tests/fixtures/op_grads.safetensors,
read by crates/mha/tests/torch_reference.rs.

    /tmp/ref/bin/python scripts/grad_fixtures.py

For each case, `F.scaled_dot_product_attention` on random q [b, h, tq, d], k and v
[b, h_kv, tk, d] (`enable_gqa` when h_kv < h) with a boolean mask (True = may attend)
built from the case's causal offset, window and key padding; the loss is
`sum(out * w)` for a random `w`, and `torch.autograd` gives dq, dk, dv. Sizes cross the
kernel's blocks (64 queries, 128 keys). No query row is fully masked (PyTorch gives NaN
there, `mha` zeros). Dropout is not here: PyTorch's generator cannot be replayed; the
kernel's dropout is held to `mha`'s reference path instead.
"""

import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "crates", "mha", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "attention_grads.safetensors")
torch.manual_seed(20)

# name, b, h, h_kv, tq, tk, d, causal, window, padded
CASES = [
    ("causal_gqa", 2, 4, 2, 140, 140, 8, True, None, False),
    ("cross_padded", 2, 2, 2, 33, 150, 8, False, None, True),
    ("window", 1, 2, 1, 100, 100, 8, True, 20, False),
    ("offset_padded", 1, 3, 3, 70, 200, 8, True, None, True),
]

tensors = {}
for name, b, h, h_kv, tq, tk, d, causal, window, padded in CASES:
    q = torch.randn(b, h, tq, d, dtype=torch.float64)
    k = torch.randn(b, h_kv, tk, d, dtype=torch.float64)
    v = torch.randn(b, h_kv, tk, d, dtype=torch.float64)
    w = torch.randn(b, h, tq, d, dtype=torch.float64)
    allowed = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    i = torch.arange(tq).view(tq, 1) + (tk - tq)  # absolute query positions
    j = torch.arange(tk).view(1, tk)
    if causal:
        allowed &= j <= i
        if window is not None:
            allowed &= j > i - window
    keep = torch.ones(b, tk, dtype=torch.uint8)
    if padded:
        # Pad the end of each row's keys and a few scattered ones; the first key stays.
        for bi in range(b):
            keep[bi, tk - 7 * (bi + 1) :] = 0
            keep[bi, 5::11] = 0
        allowed &= keep.bool().view(b, 1, 1, tk)
    assert allowed.any(-1).all(), "a fully masked row"
    # Inputs are rounded to f32 (what the Rust side reads); gradients computed in f64.
    q, k, v, w = (x.float().double().requires_grad_(x is not w) for x in (q, k, v, w))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=h_kv < h)
    (out * w).sum().backward()
    for key, t in [("q", q), ("k", k), ("v", v), ("w", w), ("out", out)]:
        tensors[f"{name}.{key}"] = t.detach().float().contiguous()
    for key, t in [("dq", q), ("dk", k), ("dv", v)]:
        tensors[f"{name}.{key}"] = t.grad.float().contiguous()
    tensors[f"{name}.keep"] = keep
    print(name, {k: tuple(t.shape) for k, t in tensors.items() if k.startswith(name + ".d")})

save_file(tensors, OUT)
print("wrote", OUT, os.path.getsize(OUT), "bytes")


# The ops around attention. Inputs are drawn in f64, rounded to f32 (what the Rust side
# reads), and differentiated in f64; the loss is `sum(out * w)` for a random `w` (2.5 times
# the loss for the scalar cross-entropy, so the incoming gradient is not 1).
torch.manual_seed(21)
ops = {}


def leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape, dtype=torch.float64)).float().double().requires_grad_(True)


def record(prefix, out, w, inputs):
    (out * w).sum().backward()
    ops[f"{prefix}.out"] = out.detach().float()
    ops[f"{prefix}.w"] = w.float()
    for name, t in inputs.items():
        ops[f"{prefix}.{name}"] = t.detach().float().contiguous()
        ops[f"{prefix}.d{name}"] = t.grad.float().contiguous()


# LayerNorm over 48, 37 rows (more than one task of 32), eps 1e-5; the input has an offset
# and scale a one-pass variance would lose precision on.
x, weight, bias = leaf(37, 48), leaf(48), leaf(48)
with torch.no_grad():
    x.mul_(3.0).add_(5.0)
out = F.layer_norm(x, (48,), weight, bias, eps=1e-5)
record("layer_norm", out, torch.randn(37, 48, dtype=torch.float64), {"x": x, "weight": weight, "bias": bias})

# Linear: 70 rows, 24 in, 40 out, PyTorch's [out, in] weight.
x, weight, bias = leaf(70, 24), leaf(40, 24, scale=0.3), leaf(40)
out = F.linear(x, weight, bias)
record("linear", out, torch.randn(70, 40, dtype=torch.float64), {"x": x, "weight": weight, "bias": bias})

# tanh GELU over [-8, 8].
x = (torch.linspace(-8, 8, 1001, dtype=torch.float64) + 0.01 * torch.randn(1001, dtype=torch.float64))
x = x.float().double().requires_grad_(True)
out = F.gelu(x, approximate="tanh")
record("gelu", out, torch.randn(1001, dtype=torch.float64), {"x": x})

# Next-token cross-entropy: logits [3, 9, 50], targets ids[:, 1:].
logits = leaf(3, 9, 50, scale=3.0)
ids = torch.randint(0, 50, (3, 9))
loss = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
record("cross_entropy", loss, torch.tensor(2.5, dtype=torch.float64), {"logits": logits})
ops["cross_entropy.ids"] = ids.to(torch.int64)

# RMSNorm over 48, 37 rows, eps 1e-6 (drawn last, so the cases above keep their values).
x, weight = leaf(37, 48), leaf(48)
out = F.rms_norm(x, (48,), weight, eps=1e-6)
record("rms_norm", out, torch.randn(37, 48, dtype=torch.float64), {"x": x, "weight": weight})

OPS = os.path.join(os.path.dirname(__file__), "..", "crates", "kernels", "tests", "fixtures", "op_grads.safetensors")
save_file(ops, OPS)
print("wrote", OPS, os.path.getsize(OPS), "bytes")
