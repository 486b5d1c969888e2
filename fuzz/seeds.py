"""Writes small, valid seed inputs for the fuzz targets into fuzz/corpus/<target>/.

Valid seeds let the fuzzer start deep inside each format instead of at random bytes.
Run with the reference environment of scripts/ (torch, safetensors, tokenizers):

    python fuzz/seeds.py
"""

import io
import json
import os
import struct
import sys

import torch
from safetensors.torch import save
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
corpus = lambda target: os.makedirs(os.path.join(HERE, "corpus", target), exist_ok=True) or os.path.join(HERE, "corpus", target)

torch.manual_seed(0)
V, P, D, L, H = 8, 4, 4, 1, 2


def gpt2_state(prefix="transformer."):
    s = {f"{prefix}wte.weight": torch.randn(V, D), f"{prefix}wpe.weight": torch.randn(P, D)}
    for i in range(L):
        p = f"{prefix}h.{i}."
        s |= {
            p + "ln_1.weight": torch.ones(D), p + "ln_1.bias": torch.zeros(D),
            p + "attn.c_attn.weight": torch.randn(D, 3 * D), p + "attn.c_attn.bias": torch.zeros(3 * D),
            p + "attn.c_proj.weight": torch.randn(D, D), p + "attn.c_proj.bias": torch.zeros(D),
            p + "ln_2.weight": torch.ones(D), p + "ln_2.bias": torch.zeros(D),
            p + "mlp.c_fc.weight": torch.randn(D, 4 * D), p + "mlp.c_fc.bias": torch.zeros(4 * D),
            p + "mlp.c_proj.weight": torch.randn(4 * D, D), p + "mlp.c_proj.bias": torch.zeros(D),
        }
    s |= {f"{prefix}ln_f.weight": torch.ones(D), f"{prefix}ln_f.bias": torch.zeros(D)}
    return s


config = json.dumps({"model_type": "gpt2", "vocab_size": V, "n_positions": P, "n_embd": D,
                     "n_layer": L, "n_head": H}).encode()
for name, state in [("f32", gpt2_state()), ("f16_bare", {k[len("transformer."):]: v.half() for k, v in gpt2_state().items()})]:
    weights = save(state)
    # load_safetensors: two little-endian bytes giving the config's length, the config, the weights.
    with open(os.path.join(corpus("load_safetensors"), name), "wb") as f:
        f.write(struct.pack("<H", len(config)) + config + weights)

# load_safetensors: every family fixture the tests commit (Llama, Qwen3, Gemma 3, Phi-3,
# LFM2, ...), so that the loaders of other layouts than GPT-2's start from a valid file.
FAMILIES = os.path.join(HERE, "..", "crates", "block", "tests", "fixtures", "families")
for name in sorted(os.listdir(FAMILIES)):
    with open(os.path.join(FAMILIES, name, "config.json"), "rb") as f:
        family_config = f.read()
    with open(os.path.join(FAMILIES, name, "model.safetensors"), "rb") as f:
        family_weights = f.read()
    with open(os.path.join(corpus("load_safetensors"), name), "wb") as f:
        f.write(struct.pack("<H", len(family_config)) + family_config + family_weights)

# load_nanogpt: a ckpt.pt as nanoGPT's train.py writes it (Linear weights [out, in], no biases).
state = {}
for k, v in gpt2_state(prefix="").items():
    if k.endswith(".bias"):
        continue
    if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        v = v.t().contiguous()
    state["_orig_mod.transformer." + k] = v
ckpt = {"model": state, "model_args": {"n_layer": L, "n_head": H, "n_embd": D, "block_size": P,
        "bias": False, "vocab_size": V, "dropout": 0.0}, "iter_num": 1, "best_val_loss": 1.0}
torch.save(ckpt, os.path.join(corpus("load_nanogpt"), "tiny.pt"))

# tokenizer: a byte-level BPE like the ones `gpt train` writes.
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(["But soft, what light through yonder window breaks?"] * 4,
                        trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
with open(os.path.join(corpus("tokenizer"), "bpe.json"), "w") as f:
    f.write(tok.to_str())
print("seeds written under", os.path.join(HERE, "corpus"), file=sys.stderr)
