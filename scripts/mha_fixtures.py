"""Reference outputs for the `mha` crate, computed by PyTorch.

Writes crates/mha/tests/fixtures/mha_torch.safetensors (weights, inputs, masks, outputs,
attention weights, keyed "<case>.<name>") and cases.json (what each case is). The Rust test
crates/mha/tests/torch_reference.rs reads both.

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch safetensors transformers
    /tmp/ref/bin/python scripts/mha_fixtures.py

Conventions of the stored tensors:
- `key_padding_mask` is u8 in PyTorch's polarity: 1 = padding, ignored.
- `attn_mask` is float, added to the scores, shaped as the Rust side passes it
  (broadcastable to [batch, heads, q_len, kv_len]).
- `weights` are per head, [batch, heads, q_len, kv_len].
"""

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.pytorch_utils import Conv1D

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "mha", "tests", "fixtures")
torch.manual_seed(1234)
tensors = {}
cases = []


def put(case, name, t):
    tensors[f"{case}.{name}"] = t.detach().contiguous().clone()


def perturb_(module):
    """Default inits leave biases at zero, which would hide a loader that drops them."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name:
                p.add_(0.1 * torch.randn_like(p))


def torch_mha(name, d, h, b, tq, tk=None, kdim=None, vdim=None, bias=True,
              padding_lengths=None, attn_mask=None, causal=False, need_weights=True):
    """torch.nn.MultiheadAttention(batch_first=True) in eval mode."""
    tk = tk or tq
    mha = torch.nn.MultiheadAttention(d, h, bias=bias, kdim=kdim, vdim=vdim, batch_first=True).eval()
    perturb_(mha)
    self_attn = kdim is None and vdim is None and tk == tq
    q = torch.randn(b, tq, d)
    k = q if self_attn else torch.randn(b, tk, kdim or d)
    v = q if self_attn else torch.randn(b, tk, vdim or d)
    kpm = None
    if padding_lengths is not None:
        kpm = torch.arange(tk)[None, :] >= torch.tensor(padding_lengths)[:, None]
        put(name, "key_padding_mask", kpm.to(torch.uint8))
    torch_mask = None
    if causal:
        torch_mask = torch.nn.Transformer.generate_square_subsequent_mask(tq)
    if attn_mask is not None:
        # Rust gets [b, h, tq, tk] or [tq, tk]; PyTorch wants [b*h, tq, tk] or [tq, tk].
        torch_mask = attn_mask.reshape(b * h, tq, tk) if attn_mask.dim() == 4 else attn_mask
        put(name, "attn_mask", attn_mask)
    with torch.no_grad():
        out, w = mha(q, k, v, key_padding_mask=kpm, attn_mask=torch_mask, is_causal=causal,
                     need_weights=need_weights, average_attn_weights=False)
    for pname, p in mha.state_dict().items():
        put(name, "w." + pname, p)
    put(name, "query", q)
    put(name, "key", k)
    put(name, "value", v)
    put(name, "out", out)
    if need_weights:
        put(name, "weights", w)
    cases.append(dict(name=name, layout="torch_in_proj", d_model=d, n_heads=h, n_kv_heads=None,
                      kdim=kdim, vdim=vdim, bias=bias, causal=causal, self_attention=self_attn,
                      has_weights=need_weights))


def heads(x, n):
    b, t, w = x.shape
    return x.view(b, t, n, w // n).transpose(1, 2)


def merge(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def gpt2_conv1d(name, d, h, b, t):
    """GPT-2's fused c_attn / c_proj Conv1D layers (weights stored [in, out]) + causal SDPA."""
    c_attn, c_proj = Conv1D(3 * d, d), Conv1D(d, d)
    perturb_(c_attn)
    perturb_(c_proj)
    x = torch.randn(b, t, d)
    with torch.no_grad():
        qq, kk, vv = c_attn(x).split(d, dim=2)
        y = F.scaled_dot_product_attention(heads(qq, h), heads(kk, h), heads(vv, h), is_causal=True)
        out = c_proj(merge(y))
    for pname, p in c_attn.state_dict().items():
        put(name, "w.c_attn." + pname, p)
    for pname, p in c_proj.state_dict().items():
        put(name, "w.c_proj." + pname, p)
    put(name, "query", x)
    put(name, "out", out)
    cases.append(dict(name=name, layout="gpt2", d_model=d, n_heads=h, n_kv_heads=None, kdim=None,
                      vdim=None, bias=True, causal=True, self_attention=True, has_weights=False))


def separate(name, layout, names, d, h, h_kv, b, tq, tk, causal, padding_lengths=None):
    """Four nn.Linear projections, grouped-query SDPA (enable_gqa), optional key padding."""
    hd = d // h
    lin = {n: torch.nn.Linear(d, d if n in (names[0], names[3]) else h_kv * hd) for n in names}
    for m in lin.values():
        perturb_(m)
    q_in = torch.randn(b, tq, d)
    kv_in = q_in if tq == tk and causal else torch.randn(b, tk, d)
    mask = None
    if padding_lengths is not None:
        keep = torch.arange(tk)[None, :] < torch.tensor(padding_lengths)[:, None]
        put(name, "key_padding_mask", (~keep).to(torch.uint8))
        mask = keep[:, None, None, :]
    with torch.no_grad():
        q = heads(lin[names[0]](q_in), h)
        k = heads(lin[names[1]](kv_in), h_kv)
        v = heads(lin[names[2]](kv_in), h_kv)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        out = lin[names[3]](merge(y))
    for n, m in lin.items():
        for pname, p in m.state_dict().items():
            put(name, f"w.{n}.{pname}", p)
    put(name, "query", q_in)
    put(name, "key", kv_in)
    put(name, "value", kv_in)
    put(name, "out", out)
    cases.append(dict(name=name, layout=layout, d_model=d, n_heads=h, n_kv_heads=h_kv, kdim=None,
                      vdim=None, bias=True, causal=causal, self_attention=kv_in is q_in,
                      has_weights=False))


def functional(name, b, h, h_kv, tq, tk, d, causal=False, with_mask=False):
    """F.scaled_dot_product_attention on heads directly."""
    q = torch.randn(b, h, tq, d)
    k = torch.randn(b, h_kv, tk, d)
    v = torch.randn(b, h_kv, tk, d)
    mask = None
    if with_mask:
        mask = torch.randn(tq, tk)
        mask[0, 1] = float("-inf")
        put(name, "attn_mask", mask)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=h != h_kv)
    put(name, "q", q)
    put(name, "k", k)
    put(name, "v", v)
    put(name, "out", out)
    cases.append(dict(name=name, layout="functional", d_model=h * d, n_heads=h, n_kv_heads=h_kv,
                      kdim=None, vdim=None, bias=False, causal=causal, self_attention=False,
                      has_weights=False))


torch_mha("self_basic", d=16, h=4, b=2, tq=5)
torch_mha("self_nobias_one_head", d=8, h=1, b=1, tq=4, bias=False)
torch_mha("many_heads", d=32, h=8, b=2, tq=6)
torch_mha("cross_kdim_vdim", d=12, h=3, b=2, tq=3, tk=6, kdim=10, vdim=7)
torch_mha("cross_same_width", d=16, h=2, b=2, tq=4, tk=9)
torch_mha("key_padding", d=16, h=2, b=3, tq=6, padding_lengths=[6, 4, 1])
additive = torch.randn(5, 5)
additive[1, 3] = float("-inf")
additive[4, 0] = float("-inf")
torch_mha("additive", d=16, h=4, b=2, tq=5, attn_mask=additive)
torch_mha("additive_per_head", d=16, h=4, b=2, tq=3, tk=4, kdim=16, vdim=16,
          attn_mask=torch.randn(2, 4, 3, 4))
torch_mha("causal", d=16, h=4, b=2, tq=7, causal=True, need_weights=False)
torch_mha("causal_key_padding", d=16, h=4, b=2, tq=7, causal=True, padding_lengths=[7, 5],
          need_weights=False)
gpt2_conv1d("gpt2_c_attn", d=24, h=3, b=2, t=6)
separate("hf_gqa_causal", "hf", ["q_proj", "k_proj", "v_proj", "o_proj"], d=32, h=8, h_kv=2, b=2,
         tq=5, tk=5, causal=True)
separate("tutorial_mqa_padding", "tutorial", ["W_q", "W_k", "W_v", "W_o"], d=16, h=4, h_kv=1, b=2,
         tq=3, tk=5, causal=False, padding_lengths=[5, 2])
functional("sdpa_causal", b=2, h=4, h_kv=4, tq=9, tk=9, d=8, causal=True)
functional("sdpa_gqa_mask", b=1, h=6, h_kv=2, tq=5, tk=7, d=8, with_mask=True)
functional("sdpa_mqa_causal", b=2, h=4, h_kv=1, tq=6, tk=6, d=16, causal=True)
# Long enough to cross the fused kernel's query and key blocks.
functional("sdpa_long_causal", b=1, h=1, h_kv=1, tq=270, tk=270, d=8, causal=True)

os.makedirs(OUT, exist_ok=True)
save_file(tensors, os.path.join(OUT, "mha_torch.safetensors"),
          metadata={"torch": torch.__version__})
with open(os.path.join(OUT, "cases.json"), "w") as f:
    json.dump({"torch": torch.__version__, "cases": cases}, f, indent=1)
print(f"{len(cases)} cases, {len(tensors)} tensors, torch {torch.__version__}")
