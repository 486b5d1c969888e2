"""Writes the corpus of bad inputs under tests/bad-inputs/ and its manifest,
tests/bad-inputs/cases.json: for each case, the `gpt` arguments (paths relative to
tests/bad-inputs/) and a piece of the one-line error it must give.

Everything is built from micro models (vocabulary 8, width 4, one block: GPT-2, and Llama,
GPT-NeoX and GPT-Neo layouts) written here with the standard library; the nanoGPT cases start from a checkpoint written by
torch.save (run in the reference environment: python scripts/bad_inputs.py).
Two cases are inputs the fuzzers found (fuzz/README.md).
"""

import io
import json
import math
import os
import random
import shutil
import struct
import zipfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "bad-inputs")
FOUND = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "found")
V, P, D, L, H = 8, 4, 4, 1, 2
rng = random.Random(0)


def state(prefix="transformer."):
    """name -> (shape, list of floats): a GPT-2 state dict in Hugging Face's layout."""
    def t(*shape, fill=None):
        n = math.prod(shape)
        return (list(shape), [fill] * n if fill is not None else [rng.uniform(-1, 1) for _ in range(n)])
    s = {prefix + "wte.weight": t(V, D), prefix + "wpe.weight": t(P, D)}
    for i in range(L):
        p = f"{prefix}h.{i}."
        s.update({
            p + "ln_1.weight": t(D, fill=1.0), p + "ln_1.bias": t(D, fill=0.0),
            p + "attn.c_attn.weight": t(D, 3 * D), p + "attn.c_attn.bias": t(3 * D, fill=0.0),
            p + "attn.c_proj.weight": t(D, D), p + "attn.c_proj.bias": t(D, fill=0.0),
            p + "ln_2.weight": t(D, fill=1.0), p + "ln_2.bias": t(D, fill=0.0),
            p + "mlp.c_fc.weight": t(D, 4 * D), p + "mlp.c_fc.bias": t(4 * D, fill=0.0),
            p + "mlp.c_proj.weight": t(4 * D, D), p + "mlp.c_proj.bias": t(D, fill=0.0),
        })
    s.update({prefix + "ln_f.weight": t(D, fill=1.0), prefix + "ln_f.bias": t(D, fill=0.0)})
    return s


def safetensors(tensors, dtype="F32", header_patch=None):
    """The safetensors format: u64 header length, JSON header, raw little-endian data."""
    header, data = {}, b""
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if header_patch:
        header_patch(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


CONFIG = {"model_type": "gpt2", "vocab_size": V, "n_positions": P, "n_embd": D, "n_layer": L, "n_head": H}
cases = []


def model_dir(name, config=CONFIG, weights=None, tokenizer=None):
    d = os.path.join(ROOT, name)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w" if isinstance(config, dict) else "wb") as f:
        f.write(json.dumps(config) if isinstance(config, dict) else config)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(weights if weights is not None else safetensors(state()))
    if tokenizer is not None:
        with open(os.path.join(d, "tokenizer.json"), "wb") as f:
            f.write(tokenizer)
    return name


def case(name, args, expect):
    cases.append({"name": name, "args": args, "expect": expect})


def generate(model, *extra):
    return ["generate", "--model", model, "--prompt-ids", "0,1", "--max-new-tokens", "2", *extra]


shutil.rmtree(ROOT, ignore_errors=True)
os.makedirs(ROOT)

good = safetensors(state())
case("truncated weights", generate(model_dir("truncated-weights", weights=good[: len(good) // 2])), "not a valid safetensors")


def past_end(h):
    h["transformer.wte.weight"]["data_offsets"] = [0, 1 << 40]
case("header offsets past the end", generate(model_dir("offsets-past-end", weights=safetensors(state(), header_patch=past_end))), "not a valid safetensors")


def shape_lies(h):
    h["transformer.wte.weight"]["shape"] = [V, D * 1000]
case("declared shape larger than its bytes", generate(model_dir("shape-lies", weights=safetensors(state(), header_patch=shape_lies))), "not a valid safetensors")
case("header length of 2^62", generate(model_dir("huge-header-length", weights=struct.pack("<Q", 1 << 62) + good[8:])), "not a valid safetensors")
case("header is not JSON", generate(model_dir("header-not-json", weights=struct.pack("<Q", 16) + b"{not json at all" + good[8:])), "not a valid safetensors")


def as_int32(h):
    h["transformer.wte.weight"]["dtype"] = "I32"
case("integer weights", generate(model_dir("int-weights", weights=safetensors(state(), header_patch=as_int32))), "dtype")

nan = state()
nan["transformer.h.0.mlp.c_fc.weight"][1][5] = float("nan")
model_dir("nan-weights", weights=safetensors(nan))
case("NaN weight, --check-weights", generate("nan-weights", "--check-weights"), "transformer.h.0.mlp.c_fc.weight")
case("NaN weight, found while generating", generate("nan-weights"), "block 0")
inf = state()
inf["transformer.wpe.weight"][1][0] = float("inf")
case("Inf position embedding", generate(model_dir("inf-weights", weights=safetensors(inf)), "--check-weights"), "transformer.wpe.weight")

case("zero heads", generate(model_dir("zero-heads", config={**CONFIG, "n_head": 0})), "n_head")
case("heads that do not divide the width", generate(model_dir("heads-do-not-divide", config={**CONFIG, "n_head": 3})), "divide")
case("huge vocabulary", generate(model_dir("huge-vocab", config={**CONFIG, "vocab_size": 1_000_000_000})), "config implies [1000000000, 4]")
case("vocabulary beyond u32", generate(model_dir("vocab-beyond-u32", config={**CONFIG, "vocab_size": 1 << 40})), "larger than any model")
case("a billion layers", generate(model_dir("billion-layers", config={**CONFIG, "n_layer": 1_000_000_000})), "no tensor transformer.h.1.")
case("config is not JSON", generate(model_dir("config-not-json", config=b"model_type: gpt2\n")), "config.json")
case("negative width", generate(model_dir("negative-width", config={**CONFIG, "n_embd": -4})), "config.json")

with open(os.path.join(FOUND, "tokenizer-crash"), "rb") as f:
    fuzz_tokenizer = f.read()
case("tokenizer.json that is not JSON (found by fuzzing)", ["generate", "--model", model_dir("tokenizer-not-json", tokenizer=fuzz_tokenizer), "--prompt", "hi", "--max-new-tokens", "2"], "tokenizer.json")
case("tokenizer.json of the wrong structure", ["generate", "--model", model_dir("tokenizer-wrong-structure", tokenizer=b'{"model": 5, "decoder": [1, 2]}'), "--prompt", "hi"], "tokenizer.json")

with open(os.path.join(ROOT, "prompt-invalid-utf8.txt"), "wb") as f:
    f.write(b"ROMEO:\n But soft \xff\xfe what light")
case("prompt file of invalid UTF-8", ["generate", "--prompt-file", "prompt-invalid-utf8.txt"], "not UTF-8")
case("score file of invalid UTF-8", ["score", "--file", "prompt-invalid-utf8.txt"], "not UTF-8")

# nanoGPT checkpoints.
torch.manual_seed(0)
nano = {}
for k, (shape, values) in state(prefix="").items():
    if k.endswith(".bias"):
        continue
    t = torch.tensor(values).reshape(shape)
    if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        t = t.t().contiguous()
    nano["_orig_mod.transformer." + k] = t
ARGS = {"n_layer": L, "n_head": H, "n_embd": D, "block_size": P, "bias": False, "vocab_size": V, "dropout": 0.0}


def pt(name, ckpt=None, raw=None):
    path = os.path.join(ROOT, name)
    if raw is not None:
        with open(path, "wb") as f:
            f.write(raw)
    else:
        torch.save(ckpt, path)
    return name


def rezip(src, dst, edit):
    """Copies a torch zip, passing each entry's (name, bytes) through `edit`."""
    with zipfile.ZipFile(os.path.join(ROOT, src)) as zin, zipfile.ZipFile(os.path.join(ROOT, dst), "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            name, data, method = edit(info.filename, zin.read(info.filename))
            zout.writestr(name, data, compress_type=method)
    return dst


base = pt("nanogpt-base.pt", {"model": nano, "model_args": ARGS})
case("nanoGPT checkpoint that is not a zip", generate(pt("nanogpt-not-zip.pt", raw=b"this is not a checkpoint\n" * 4)), "not a PyTorch zip")
with open(os.path.join(FOUND, "nanogpt-4gb-string"), "rb") as f:
    # The zip layer now refuses this one (its CRC no longer matches after the fuzzer's edit);
    # the next case is the same 4 GB string in an intact zip.
    case("zip entry with a bad checksum (found by fuzzing)", generate(pt("nanogpt-4gb-string.pt", raw=f.read())), "checksum")


def pickle_edit(pkl):
    return lambda n, d: (n, pkl if n.endswith("data.pkl") else d, zipfile.ZIP_STORED)


case("pickle string of 4 GB in a small file", generate(rezip(base, "nanogpt-4gb-string-intact.pt", pickle_edit(b"\x80\x02X\xff\xff\xff\xffabc"))), "pickle: truncated")
# A memo bomb: each round builds a tuple of 8 copies of the last, 8^10 objects in all.
bomb = b"\x80\x02]q\x00" + (b"(" + b"h\x00" * 8 + b"tq\x00") * 10 + b"."
case("pickle memo bomb", generate(rezip(base, "nanogpt-memo-bomb.pt", pickle_edit(bomb))), "pickle: builds more than")
case("pickle nested 100000 deep", generate(rezip(base, "nanogpt-deep-nesting.pt", pickle_edit(b"\x80\x02N" + b"\x85" * 100_000 + b"."))), "nested")
case("pickle LONG1 of 255 bytes", generate(rezip(base, "nanogpt-long1.pt", pickle_edit(b"\x80\x02\x8a\xff" + b"\x01" * 255 + b"."))), "LONG1")
case("compressed zip entries", generate(rezip(base, "nanogpt-compressed.pt", lambda n, d: (n, d, zipfile.ZIP_DEFLATED))), "compressed")
case("tensor storage shorter than its shape", generate(rezip(base, "nanogpt-short-storage.pt", lambda n, d: (n, d[:8] if n.endswith("data/0") else d, zipfile.ZIP_STORED))), "past the end of its storage")
case("model_args disagree with the tensors", generate(pt("nanogpt-wrong-width.pt", {"model": nano, "model_args": {**ARGS, "n_embd": 8, "n_head": 2}})), "config implies")
case("model_args with a huge block size", generate(pt("nanogpt-huge-block.pt", {"model": nano, "model_args": {**ARGS, "block_size": 1 << 40}})), "block_size")

# Other families: the same checks before anything is allocated.
I = 8  # MLP width of the micro Llama and NeoX models


def t(*shape, fill=None):
    n = math.prod(shape)
    return (list(shape), [fill] * n if fill is not None else [rng.uniform(-1, 1) for _ in range(n)])


def llama_state():
    s = {"model.embed_tokens.weight": t(V, D), "model.norm.weight": t(D, fill=1.0)}
    p = "model.layers.0."
    s.update({
        p + "input_layernorm.weight": t(D, fill=1.0), p + "post_attention_layernorm.weight": t(D, fill=1.0),
        p + "self_attn.q_proj.weight": t(D, D), p + "self_attn.k_proj.weight": t(D // H, D),
        p + "self_attn.v_proj.weight": t(D // H, D), p + "self_attn.o_proj.weight": t(D, D),
        p + "mlp.gate_proj.weight": t(I, D), p + "mlp.up_proj.weight": t(I, D), p + "mlp.down_proj.weight": t(D, I),
    })
    return s


def neox_state(qkv_rows=3 * D):
    s = {"gpt_neox.embed_in.weight": t(V, D), "embed_out.weight": t(V, D),
         "gpt_neox.final_layer_norm.weight": t(D, fill=1.0), "gpt_neox.final_layer_norm.bias": t(D, fill=0.0)}
    p = "gpt_neox.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        s.update({p + n + ".weight": t(D, fill=1.0), p + n + ".bias": t(D, fill=0.0)})
    s.update({
        p + "attention.query_key_value.weight": t(qkv_rows, D), p + "attention.query_key_value.bias": t(qkv_rows),
        p + "attention.dense.weight": t(D, D), p + "attention.dense.bias": t(D),
        p + "mlp.dense_h_to_4h.weight": t(I, D), p + "mlp.dense_h_to_4h.bias": t(I),
        p + "mlp.dense_4h_to_h.weight": t(D, I), p + "mlp.dense_4h_to_h.bias": t(D),
    })
    return s


def neo_state():
    s = {"transformer.wte.weight": t(V, D), "transformer.wpe.weight": t(P, D),
         "transformer.ln_f.weight": t(D, fill=1.0), "transformer.ln_f.bias": t(D, fill=0.0)}
    p = "transformer.h.0."
    for n in ("ln_1", "ln_2"):
        s.update({p + n + ".weight": t(D, fill=1.0), p + n + ".bias": t(D, fill=0.0)})
    for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
        s[p + "attn.attention." + n + ".weight"] = t(D, D)
    s.update({p + "attn.attention.out_proj.bias": t(D),
              p + "mlp.c_fc.weight": t(4 * D, D), p + "mlp.c_fc.bias": t(4 * D),
              p + "mlp.c_proj.weight": t(D, 4 * D), p + "mlp.c_proj.bias": t(D)})
    return s


LLAMA = {"model_type": "llama", "vocab_size": V, "hidden_size": D, "intermediate_size": I,
         "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": 1,
         "max_position_embeddings": P, "tie_word_embeddings": True}
NEOX = {"model_type": "gpt_neox", "vocab_size": V, "hidden_size": D, "intermediate_size": I,
        "num_hidden_layers": L, "num_attention_heads": H, "max_position_embeddings": P, "rotary_pct": 1.0}
NEO = {"model_type": "gpt_neo", "vocab_size": V, "hidden_size": D, "num_layers": L, "num_heads": H,
       "max_position_embeddings": P, "attention_types": [[["local"], 1]], "window_size": 2}
llama, neo = safetensors(llama_state()), safetensors(neo_state())
case("llama: a billion layers", generate(model_dir("llama-billion-layers", config={**LLAMA, "num_hidden_layers": 1_000_000_000}, weights=llama)), "no tensor model.layers.1.")
case("mistral: a billion sliding-window layers", generate(model_dir("mistral-billion-layers", config={**LLAMA, "model_type": "mistral", "sliding_window": 2, "num_hidden_layers": 1_000_000_000}, weights=llama)), "no tensor model.layers.1.")
case("gpt_neo: attention_types of a billion layers", generate(model_dir("neo-billion-layers", config={**NEO, "num_layers": 1_000_000_000, "attention_types": [[["global", "local"], 500_000_000]]}, weights=neo)), "no tensor transformer.h.1.")
case("gpt_neo: attention_types repeated 2^60 times", generate(model_dir("neo-huge-repeat", config={**NEO, "attention_types": [[["global", "local"], 1 << 60]]}, weights=neo)), "attention_types")
case("llama: huge MLP width", generate(model_dir("llama-huge-mlp", config={**LLAMA, "intermediate_size": 1_000_000_000}, weights=llama)), "config implies [1000000000, 4]")
case("llama: unsupported RoPE scaling", generate(model_dir("llama-yarn", config={**LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0}}, weights=llama)), "rope_scaling type \"yarn\"")
case("llama: key/value heads that do not divide", generate(model_dir("llama-kv-heads", config={**LLAMA, "num_key_value_heads": 3}, weights=llama)), "num_key_value_heads=3")
case("gpt_neox: query_key_value of the wrong shape", generate(model_dir("neox-qkv-shape", config=NEOX, weights=safetensors(neox_state(qkv_rows=2 * D)))), "query_key_value.weight")
case("unknown model_type", generate(model_dir("unknown-model-type", config={**LLAMA, "model_type": "mamba"}, weights=llama)), "model_type \"mamba\"")
# The newer families' fields, on the micro Llama's weights (no allocation follows a bad value).
case("qwen3: heads of 2^31", generate(model_dir("qwen3-huge-head-dim", config={**LLAMA, "model_type": "qwen3", "head_dim": 1 << 31}, weights=llama)), "head_dim=2147483648")
case("qwen3: heads of width 0", generate(model_dir("qwen3-zero-head-dim", config={**LLAMA, "model_type": "qwen3", "head_dim": 0}, weights=llama)), "head_dim must be positive")
case("qwen3: no q/k norm weights", generate(model_dir("qwen3-no-qk-norm", config={**LLAMA, "model_type": "qwen3"}, weights=llama)), "model.layers.0.self_attn.q_norm.weight")
case("qwen3: a window of 0", generate(model_dir("qwen3-window-0", config={**LLAMA, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0}, weights=llama)), "window")
case("smollm3: no_rope_layers of the wrong length", generate(model_dir("smollm3-no-rope-length", config={**LLAMA, "model_type": "smollm3", "no_rope_layers": [1, 0, 1]}, weights=llama)), "no_rope_layers has 3 entries for num_hidden_layers=1")
case("smollm3: a NoPE interval of 0", generate(model_dir("smollm3-interval-0", config={**LLAMA, "model_type": "smollm3", "no_rope_layer_interval": 0}, weights=llama)), "no_rope_layer_interval must be positive")
case("smollm3: a NoPE interval of 2^60 over a billion layers", generate(model_dir("smollm3-huge-interval", config={**LLAMA, "model_type": "smollm3", "no_rope_layer_interval": 1 << 60, "num_hidden_layers": 1_000_000_000}, weights=llama)), "no_rope_layer_interval must be a non-negative integer below 2^32")
case("smollm3: a NoPE interval of 2^31 over a billion layers", generate(model_dir("smollm3-billion-layers", config={**LLAMA, "model_type": "smollm3", "no_rope_layer_interval": 1 << 31, "num_hidden_layers": 1_000_000_000}, weights=llama)), "no tensor model.layers.1.")
case("olmo2: no post-branch norm weights", generate(model_dir("olmo2-llama-weights", config={**LLAMA, "model_type": "olmo2"}, weights=llama)), "post_feedforward_layernorm")
case("granite: logits divided by 0", generate(model_dir("granite-logits-0", config={**LLAMA, "model_type": "granite", "logits_scaling": 0}, weights=llama)), "logits_scaling must be a positive number")
case("granite: an infinite embedding multiplier", generate(model_dir("granite-inf-multiplier", config=b'{"model_type": "granite", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4, "embedding_multiplier": 1e999}', weights=llama)), "number out of range")
case("granite: a negative residual multiplier", generate(model_dir("granite-negative-residual", config={**LLAMA, "model_type": "granite", "residual_multiplier": -0.5}, weights=llama)), "residual_multiplier must be a positive number")
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 2}
case("longrope: factors of the wrong length", generate(model_dir("longrope-short-length", config={**LLAMA, "rope_parameters": {**LONGROPE, "short_factor": [1.0, 1.0, 1.0], "long_factor": [1.0]}}, weights=llama)), "longrope short_factor has 3 entries for 1 frequencies")
case("longrope: a factor of 0", generate(model_dir("longrope-zero-factor", config={**LLAMA, "rope_parameters": {**LONGROPE, "short_factor": [0.0], "long_factor": [1.0]}}, weights=llama)), "short_factor entries must be positive numbers")
case("longrope: no long factors", generate(model_dir("longrope-no-long", config={**LLAMA, "rope_parameters": {**LONGROPE, "short_factor": [1.0]}}, weights=llama)), "longrope needs long_factor")
PHI3 = {**LLAMA, "model_type": "phi3"}
case("phi3: q/k/v stored separately", generate(model_dir("phi3-separate-qkv", config=PHI3, weights=llama)), "phi3 files store it inside the fused")


def phi3_state(qkv_rows):
    s = llama_state()
    p = "model.layers.0."
    for n in ("q_proj", "k_proj", "v_proj"):
        del s[p + "self_attn." + n + ".weight"]
    del s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]
    s[p + "self_attn.qkv_proj.weight"] = t(qkv_rows, D)
    s[p + "mlp.gate_up_proj.weight"] = t(2 * I, D)
    return s


case("phi3: a fused q/k/v of the wrong height", generate(model_dir("phi3-qkv-rows", config=PHI3, weights=safetensors(phi3_state(3 * D)))), "tensor model.layers.0.self_attn.qkv_proj.weight is [12, 4], expected [8, 4]")
LFM2 = {**LLAMA, "model_type": "lfm2", "layer_types": ["conv"]}
case("lfm2: a billion conv taps", generate(model_dir("lfm2-billion-taps", config={**LFM2, "conv_L_cache": 1_000_000_000}, weights=llama)), "conv_L_cache=1000000000 must be in 1..=1024")
case("lfm2: no conv taps", generate(model_dir("lfm2-zero-taps", config={**LFM2, "conv_L_cache": 0}, weights=llama)), "conv_L_cache=0 must be in 1..=1024")
case("lfm2: layer_types of the wrong length", generate(model_dir("lfm2-layer-types", config={**LFM2, "layer_types": ["conv", "full_attention"]}, weights=llama)), "layer_types has 2 entries for num_hidden_layers=1")
case("lfm2: an unknown layer type", generate(model_dir("lfm2-layer-kind", config={**LFM2, "layer_types": ["mamba"]}, weights=llama)), "layer_types entry \"mamba\" is not supported")
case("lfm2: an attention layer past the last", generate(model_dir("lfm2-attn-idx", config={**{k: v for k, v in LFM2.items() if k != "layer_types"}, "full_attn_idxs": [5]}, weights=llama)), "full_attn_idxs entry 5 is not a layer below 1")
case("lfm2: full_attn_idxs over a billion layers", generate(model_dir("lfm2-billion-layers", config={**{k: v for k, v in LFM2.items() if k != "layer_types"}, "full_attn_idxs": [0, 999_999_999], "num_hidden_layers": 1_000_000_000}, weights=llama)), "model.layers.0.")
case("lfm2: a checkpoint with Llama's names", generate(model_dir("lfm2-conv-missing", config=LFM2, weights=llama)), "no tensor model.layers.0.operator_norm.weight")
GEMMA = {**LLAMA, "model_type": "gemma3_text"}
case("gemma3: a window of 0", generate(model_dir("gemma3-window-0", config={**GEMMA, "sliding_window": 0}, weights=llama)), "window")
case("gemma3: a window pattern of period 0", generate(model_dir("gemma3-pattern-0", config={**GEMMA, "sliding_window_pattern": 0}, weights=llama)), "sliding_window_pattern must be positive")
case("gemma3: a window pattern of period 2^31 over a billion layers", generate(model_dir("gemma3-huge-pattern", config={**GEMMA, "sliding_window_pattern": 1 << 31, "num_hidden_layers": 1_000_000_000}, weights=llama)), "no tensor model.layers.0.pre_feedforward_layernorm")
case("gemma3: a window pattern of period 2^20 within a billion layers", generate(model_dir("gemma3-long-pattern", config={**GEMMA, "sliding_window_pattern": 1 << 20, "num_hidden_layers": 1_000_000_000}, weights=llama)), "sliding-window pattern of period 1048576")
case("gemma3: layer_types of the wrong length", generate(model_dir("gemma3-layer-types", config={**GEMMA, "layer_types": ["sliding_attention", "full_attention"]}, weights=llama)), "layer_types has 2 entries for num_hidden_layers=1")
case("gemma3: a negative attention cap", generate(model_dir("gemma3-attn-softcap", config={**GEMMA, "attn_logit_softcapping": -50.0}, weights=llama)), "attn_logit_softcapping must be a positive number")
case("gemma3: a logit cap of 0", generate(model_dir("gemma3-cap-0", config={**GEMMA, "final_logit_softcapping": 0}, weights=llama)), "final_logit_softcapping must be a positive number")
case("gemma3: a local rope that is not an object", generate(model_dir("gemma3-rope-local", config={**GEMMA, "rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": 5}}, weights=llama)), "rope_parameters.sliding_attention must be an object")
case("gemma3: a negative query_pre_attn_scalar", generate(model_dir("gemma3-qpas", config={**GEMMA, "query_pre_attn_scalar": -4}, weights=llama)), "query_pre_attn_scalar must be positive")


# GGUF (llama.cpp's format): a micro Llama written here field by field, then broken.
GGUF_TYPES = {"u32": 4, "i32": 5, "f32": 6, "bool": 7, "string": 8, "array": 9, "u64": 10}


def gguf_string(text):
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(kind, value):
    if kind == "u32":
        return struct.pack("<I", value)
    if kind == "i32":
        return struct.pack("<i", value)
    if kind == "u64":
        return struct.pack("<Q", value)
    if kind == "f32":
        return struct.pack("<f", value)
    if kind == "bool":
        return struct.pack("<B", value)
    if kind == "string":
        return gguf_string(value)
    elem, items = value
    return (struct.pack("<IQ", GGUF_TYPES[elem], len(items))
            + b"".join(gguf_value(elem, x) for x in items))


def gguf(metadata, tensors, n_tensors=None, edit_info=None, alignment=32):
    """metadata: [(key, kind, value)]; tensors: [(name, dims as ggml ne, ggml type, bytes)]."""
    out = b"GGUF" + struct.pack("<I", 3)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(metadata))
    for key, kind, value in metadata:
        out += gguf_string(key) + struct.pack("<I", GGUF_TYPES[kind]) + gguf_value(kind, value)
    data, infos = b"", []
    for name, ne, ggml_type, raw in tensors:
        data += b"\0" * (-len(data) % 32)
        infos.append([name, ne, ggml_type, len(data)])
        data += raw
    if edit_info:
        edit_info(infos)
    for name, ne, ggml_type, offset in infos:
        out += gguf_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % max(alignment, 1))
    return out + data


def f32(*ne):
    n = math.prod(ne)
    return (list(ne), 0, struct.pack(f"<{n}f", *[rng.uniform(-1, 1) for _ in range(n)]))


def micro_llama(layers=L, extra_meta=(), arch="llama"):
    meta = [("general.architecture", "string", arch), (f"{arch}.block_count", "u32", layers),
            (f"{arch}.context_length", "u32", P), (f"{arch}.embedding_length", "u32", D),
            (f"{arch}.feed_forward_length", "u32", I), (f"{arch}.attention.head_count", "u32", H),
            (f"{arch}.attention.head_count_kv", "u32", 1),
            (f"{arch}.attention.layer_norm_rms_epsilon", "f32", 1e-6),
            ("tokenizer.ggml.model", "string", "gpt2"),
            ("tokenizer.ggml.tokens", "array", ("string", [chr(97 + i) for i in range(V)])),
            ("tokenizer.ggml.merges", "array", ("string", ["a b"]))]
    meta += list(extra_meta)
    hd = D // H
    t = [("token_embd.weight", *f32(D, V)), ("output_norm.weight", *f32(D))]
    for i in range(L):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", *f32(D)), (b + "ffn_norm.weight", *f32(D)),
              (b + "attn_q.weight", *f32(D, D)), (b + "attn_k.weight", *f32(D, hd)),
              (b + "attn_v.weight", *f32(D, hd)), (b + "attn_output.weight", *f32(D, D)),
              (b + "ffn_gate.weight", *f32(D, I)), (b + "ffn_up.weight", *f32(D, I)),
              (b + "ffn_down.weight", *f32(I, D))]
    return meta, t


def gguf_file(name, data):
    with open(os.path.join(ROOT, name), "wb") as f:
        f.write(data)
    return name


meta, tensors = micro_llama()
good_gguf = gguf(meta, tensors)
case("gguf: truncated", generate(gguf_file("gguf-truncated.gguf", good_gguf[: len(good_gguf) * 2 // 3])), "not a valid GGUF file")
case("gguf: a tensor count of 2^40", generate(gguf_file("gguf-tensor-count.gguf", gguf(meta, tensors, n_tensors=1 << 40))), "not a valid GGUF file")
case("gguf: a string of 2^28 bytes in a small file", generate(gguf_file("gguf-string-past-end.gguf", gguf(meta + [("general.name", "string", "x")], tensors).replace(gguf_string("general.name") + struct.pack("<I", 8) + gguf_string("x"), gguf_string("general.name") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 28) + b"x"))), "not a valid GGUF file")


def offset_past_end(infos):
    infos[0][3] = 1 << 40
case("gguf: a tensor offset past the end", generate(gguf_file("gguf-offset-past-end.gguf", gguf(meta, tensors, edit_info=offset_past_end))), "run past the end")


def overlap(infos):
    infos[1][3] = infos[0][3]
case("gguf: overlapping tensors", generate(gguf_file("gguf-overlap.gguf", gguf(meta, tensors, edit_info=overlap))), "overlap")


def unknown_type(infos):
    infos[2][2] = 39
case("gguf: an unknown tensor type", generate(gguf_file("gguf-unknown-type.gguf", gguf(meta, tensors, edit_info=unknown_type))), "unknown dtype")


def billion_dims(infos):
    infos[0][1] = [1 << 20] * 4
case("gguf: a tensor of 2^80 elements", generate(gguf_file("gguf-huge-dims.gguf", gguf(meta, tensors, edit_info=billion_dims))), "too many elements")


def many_dims(infos):
    infos[0][1] = [1] * 1_000_000
case("gguf: a million dimensions", generate(gguf_file("gguf-million-dims.gguf", gguf(meta, tensors, edit_info=many_dims))), "dimensions")


def not_whole_blocks(infos):
    infos[2][2] = 8  # Q8_0 rows of 4 values
case("gguf: rows that are not whole blocks", generate(gguf_file("gguf-partial-blocks.gguf", gguf(meta, tensors, edit_info=not_whole_blocks))), "not whole Q8_0 blocks")
huge_vocab = [m if m[0] != "tokenizer.ggml.tokens" else ("tokenizer.ggml.tokens", "array", ("string", ["a"])) for m in meta]
case("gguf: a vocabulary of 2^29 strings in a small file", generate(gguf_file("gguf-huge-vocab.gguf", gguf(huge_vocab, tensors).replace(struct.pack("<IQ", 8, 1) + gguf_string("a"), struct.pack("<IQ", 8, 1 << 29) + gguf_string("a")))), "not a valid GGUF file")
case("gguf: alignment 0", generate(gguf_file("gguf-alignment-0.gguf", gguf(meta + [("general.alignment", "u32", 0)], tensors))), "not a valid GGUF file")
case("gguf: a billion blocks", generate(gguf_file("gguf-billion-blocks.gguf", gguf(*micro_llama(layers=1_000_000_000)))), "blk.1.")
case("gguf: unsupported architecture", generate(gguf_file("gguf-mamba.gguf", gguf(*micro_llama(arch="mamba")))), "architecture \"mamba\" is not supported")
case("gguf: heads that do not divide the width", generate(gguf_file("gguf-heads.gguf", gguf([m if m[0] != "llama.attention.head_count" else (m[0], "u32", 3) for m in meta], tensors))), "head_count=3")
# Found by fuzzing `load_gguf` (loading for inference): a width the tensors do not have
# sized the buffer the float matrices are read into before any was read.
case("gguf: a feed-forward width of 2^27 over tensors of width 8", generate(gguf_file("gguf-lying-ffn.gguf", gguf([m if m[0] != "llama.feed_forward_length" else (m[0], "u32", 1 << 27) for m in meta], tensors))), "ffn_down.weight has shape [4, 8], the config needs [4, 134217728]")
# Found by fuzzing `load_gguf` (loading as stored): the rows of a Llama's q were put back in
# rotary order by an index of the claimed width, made before the tensor's shape was checked.
case("gguf: a head width of 2^30 over q of width 4", ["inspect", "--model", gguf_file("gguf-lying-head-width.gguf", gguf(meta + [("llama.attention.key_length", "u32", 1 << 30), ("llama.attention.value_length", "u32", 1 << 30)], tensors))], "attn_q.weight has shape [4, 4], the config needs [2147483648, 4]")
case("gguf: a tensor the model does not know (Llama 3.1's rope_freqs)", generate(gguf_file("gguf-rope-freqs.gguf", gguf(meta, tensors + [("rope_freqs.weight", *f32(D // H // 2))]))), "tensor rope_freqs.weight")
case("gguf: a token id outside the vocabulary", generate(gguf_file("gguf-bad-bos.gguf", gguf(meta + [("tokenizer.ggml.bos_token_id", "u32", 1 << 30)], tensors))), "outside the 8 tokens")

os.remove(os.path.join(ROOT, base))
with open(os.path.join(ROOT, "cases.json"), "w") as f:
    json.dump(cases, f, indent=1)
    f.write("\n")
print(f"{len(cases)} cases in {os.path.normpath(ROOT)}")
