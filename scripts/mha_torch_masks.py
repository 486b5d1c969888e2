"""PyTorch references for `mha`'s boolean attention masks and for loading a state dict
saved with `torch.save`.

Writes crates/mha/tests/fixtures/torch_masks.safetensors and torch_state_dict.pt, read by
crates/mha/tests/torch_masks.rs.

    /tmp/ref/bin/python scripts/mha_torch_masks.py

The layer is `nn.MultiheadAttention(16, 4, batch_first=True)` with every bias redrawn.
Boolean masks are stored as uint8 with PyTorch's polarity (1 = not allowed); every query
keeps at least one key (PyTorch returns NaN for a fully masked row, `mha` the output bias).
"""

import os

import torch
import torch.nn as nn
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "mha", "tests", "fixtures")
torch.manual_seed(7)
E, H, B, T, S = 16, 4, 2, 5, 6
layer = nn.MultiheadAttention(E, H, batch_first=True)
with torch.no_grad():
    for name, p in layer.named_parameters():
        if "bias" in name:
            p.add_(0.1 * torch.randn_like(p))
layer.eval()
torch.save(layer.state_dict(), os.path.join(OUT, "torch_state_dict.pt"))

q = torch.randn(B, T, E)
kv = torch.randn(B, S, E)
tensors = {"query": q, "key_value": kv}
for name, p in layer.state_dict().items():
    tensors[f"layer.{name}"] = p.detach().clone()


def random_mask(*dims):
    """True = not allowed; key j = (i mod S) always allowed, so no row is empty."""
    m = torch.rand(*dims) < 0.4
    for i in range(dims[-2]):
        m[..., i, i % S] = False
    return m


with torch.no_grad():
    # [T, S]: one mask for every batch row and head.
    m2 = random_mask(T, S)
    tensors["mask_2d"] = m2.to(torch.uint8)
    tensors["out_2d"] = layer(q, kv, kv, attn_mask=m2, need_weights=False)[0]
    # [B·H, T, S]: PyTorch's per-head form.
    m3 = random_mask(B * H, T, S)
    tensors["mask_heads"] = m3.to(torch.uint8)
    tensors["out_heads"] = layer(q, kv, kv, attn_mask=m3, need_weights=False)[0]
    # [B, T, S]: one mask per batch row, shared by its heads (PyTorch needs it repeated).
    mb = random_mask(B, T, S)
    tensors["mask_batch"] = mb.to(torch.uint8)
    tensors["out_batch"] = layer(q, kv, kv, attn_mask=mb.repeat_interleave(H, dim=0),
                                 need_weights=False)[0]
    # The boolean mask together with a key padding mask (True = padding).
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 4:] = True
    tensors["padding"] = pad.to(torch.uint8)
    tensors["out_2d_padded"] = layer(q, kv, kv, attn_mask=m2, key_padding_mask=pad,
                                     need_weights=False)[0]
    # Self-attention through the torch.save'd state dict.
    tensors["out_self"] = layer(q, q, q, need_weights=False)[0]

# add_bias_kv and add_zero_attn, alone and together, plain, with a boolean mask and key
# padding, and causal (PyTorch pads every mask with a visible column per added position);
# per-head weights too.
for name, kwargs in [("bkv", dict(add_bias_kv=True)), ("zero", dict(add_zero_attn=True)),
                     ("both", dict(add_bias_kv=True, add_zero_attn=True))]:
    extra = nn.MultiheadAttention(E, H, batch_first=True, **kwargs)
    with torch.no_grad():
        for pname, p in extra.named_parameters():
            if "bias" in pname:
                p.add_(0.1 * torch.randn_like(p))
    extra.eval()
    for pname, p in extra.state_dict().items():
        tensors[f"{name}.{pname}"] = p.detach().clone()
    with torch.no_grad():
        out, w = extra(q, kv, kv, need_weights=True, average_attn_weights=False)
        tensors[f"{name}.out"], tensors[f"{name}.weights"] = out, w
        tensors[f"{name}.out_masked"] = extra(q, kv, kv, attn_mask=m2, key_padding_mask=pad,
                                              need_weights=False)[0]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        tensors[f"{name}.out_causal"] = extra(q, q, q, attn_mask=causal, need_weights=False)[0]

save_file({k: v.contiguous() for k, v in tensors.items()},
          os.path.join(OUT, "torch_masks.safetensors"))
print("wrote", len(tensors), "tensors; torch", torch.__version__)
