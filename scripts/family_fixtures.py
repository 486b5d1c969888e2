"""Small random-weight checkpoints of the Llama, Mistral, Qwen2, GPT-NeoX, GPT-Neo, Qwen3,
SmolLM3, OLMo 2, Granite, Gemma 2 and Gemma 3 families, and what Hugging Face transformers computes with
them. Read by crates/block/tests/families.rs.

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers safetensors
    /tmp/ref/bin/python scripts/family_fixtures.py [name ...]

With names, only those fixtures are (re)written.

Each crates/block/tests/fixtures/families/<name>/ gets what `save_pretrained` writes
(config.json with transformers 5's `rope_parameters`, model.safetensors), the same config
in the field names of the hub's older files (config.legacy.json: top-level `rope_theta` and
`rope_scaling`, NeoX's `rotary_pct`/`rotary_emb_base`, Qwen2 without `layer_types`, Gemma 3's
`rope_local_base_freq` and `sliding_window_pattern`), and
expected.safetensors:
- input_ids [2, T] (i64), logits [2, T, vocab] (f32): model(input_ids).logits
- loss (f32 scalar): model(input_ids[:1], labels=input_ids[:1]).loss
- prompt [1, P], greedy [1, N]: generate(do_sample=False, max_new_tokens=N) new tokens
- margins [N]: top-1 minus top-2 logit at each greedy step (near ties may be skipped)

Weights are redrawn at scales that make every part matter (matrices with std
1/sqrt(fan_in), norms 1 + 0.1·noise (Gemma's, stored as w for 1 + w: 0.1·noise), biases
0.1·noise): the default init (std 0.02, unit
norms, zero biases) gives near-uniform logits and would hide a loader that drops or swaps
a part. Attention is transformers' eager implementation.
"""

import json
import math
import os
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaTokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..", "crates", "block", "tests", "fixtures",
                    "families")
T = 12  # longer than every window below, so local attention changes the result
ONLY = set(sys.argv[1:])


def legacy(cfg):
    """config.json as the hub's pre-transformers-5 files spell it."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters", None)
    if cfg["model_type"] in ("qwen2", "qwen3", "smollm3"):
        cfg.pop("layer_types", None)
    if cfg["model_type"] == "smollm3":
        # The hub's files give the interval and let transformers list the layers.
        cfg.pop("no_rope_layers", None)
    if cfg["model_type"] == "lfm2":
        # The hub's LFM2 files list the attention layers instead of every layer's type.
        types = cfg.pop("layer_types")
        cfg["full_attn_idxs"] = [i for i, t in enumerate(types) if t == "full_attention"]
    if cfg["model_type"] == "gemma2":
        # The hub's Gemma 2 files: no layer list (every even layer slides).
        cfg.pop("layer_types", None)
    if cfg["model_type"] == "gemma3_text":
        # The hub's Gemma 3 files: a period instead of the list, the local base beside the
        # global one, the global scaling as rope_scaling.
        types = cfg.pop("layer_types")
        p = next(p for p in range(1, len(types) + 2)
                 if types == ["sliding_attention" if (i + 1) % p else "full_attention"
                              for i in range(len(types))])
        cfg["sliding_window_pattern"] = p
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        full = dict(rope["full_attention"])
        cfg["rope_theta"] = full.pop("rope_theta")
        if full.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {"type": full.pop("rope_type"), **full}
        return cfg
    if rope is not None:
        kind = rope.get("rope_type", "default")
        if cfg["model_type"] == "gpt_neox":
            cfg["rotary_emb_base"] = rope["rope_theta"]
            cfg["rotary_pct"] = rope.get("partial_rotary_factor", 1.0)
        else:
            cfg["rope_theta"] = rope["rope_theta"]
            if "partial_rotary_factor" in rope:
                cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if kind == "longrope":
            # Phi-3's files: the factors under rope_scaling, the original context on top.
            cfg["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
            cfg["rope_scaling"] = {"type": kind, "short_factor": rope["short_factor"],
                                   "long_factor": rope["long_factor"]}
        elif kind != "default":
            # Older files say "type"; newer pre-5 files "rope_type". Both are read.
            cfg["rope_scaling"] = {"type": kind, "factor": rope["factor"]}
    return cfg


def build(name, family, seed, tokenizer=None, **kw):
    if ONLY and name not in ONLY:
        return
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **kw)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 3:  # LFM2's depthwise convolution [d, 1, taps]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[2]))
            elif "norm" in pname or "ln" in pname:
                if pname.endswith("weight"):
                    shift = 0.0 if family in ("gemma2", "gemma3_text") else 1.0
                    p.copy_(shift + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))
            else:  # biases
                p.copy_(0.1 * torch.randn_like(p))
    out = os.path.join(ROOT, name)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    # generation_config.json is not read by us; keep the fixture to what the loader needs.
    gen_cfg = os.path.join(out, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    with open(os.path.join(out, "config.legacy.json"), "w") as f:
        json.dump(legacy(written), f, indent=2, sort_keys=True)

    vocab = config.vocab_size
    input_ids = torch.randint(0, vocab, (2, T))
    with torch.no_grad():
        logits = model(input_ids).logits
        loss = model(input_ids[:1], labels=input_ids[:1]).loss
        prompt = torch.randint(0, vocab, (1, 5))
        n_new = 10
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0,
                             eos_token_id=None, output_scores=True,
                             return_dict_in_generate=True)
        greedy = gen.sequences[:, prompt.shape[1]:]
        margins = torch.stack([s[0].topk(2).values[0] - s[0].topk(2).values[1]
                               for s in gen.scores])
    save_file({
        "input_ids": input_ids.contiguous(),
        "logits": logits.float().contiguous(),
        "loss": loss.float().reshape(()),
        "prompt": prompt.contiguous(),
        "greedy": greedy.contiguous(),
        "margins": margins.float().contiguous(),
    }, os.path.join(out, "expected.safetensors"))
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {family}, {n} parameters, loss {loss.item():.6f}, "
          f"smallest greedy margin {margins.min().item():.2e}")
    return model, input_ids, out


common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=48, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)

# GQA (4 query heads over 2 kv heads), biases on every projection, untied head, theta 500.
build("llama_gqa_bias", "llama", 11, num_key_value_heads=2, attention_bias=True,
      mlp_bias=True, tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **common)
# Multi-query attention, tied head, linear RoPE scaling, no biases.
build("llama_mqa_linear", "llama", 12, num_key_value_heads=1, tie_word_embeddings=True,
      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
      **common)
# Sliding-window attention on every layer (window 5 < T), GQA.
build("mistral_window", "mistral", 13, num_key_value_heads=2, sliding_window=5,
      tie_word_embeddings=False, **common)
# q/k/v biases (o_proj has none), tied head, the second layer windowed (max_window_layers).
build("qwen2_bias_window", "qwen2", 14, num_key_value_heads=2, tie_word_embeddings=True,
      use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)
# Partial rotary (a quarter of each head), parallel residual, untied head, exact GELU.
build("neox_parallel", "gpt_neox", 15, rotary_pct=0.25, use_parallel_residual=True,
      tie_word_embeddings=False, **common)
# Half rotary, sequential residual, theta 1000.
build("neox_sequential", "gpt_neox", 16, rotary_pct=0.5, rotary_emb_base=1000,
      use_parallel_residual=False, tie_word_embeddings=False, **common)
# Global then local attention (window 4), unscaled scores, learned positions, tied head.
build("neo_local", "gpt_neo", 17, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
      attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=64,
      bos_token_id=1, eos_token_id=2)
# RMSNorm over each head of q and k, heads of 16 over a width of 32 (wider than 32 / 4),
# biases on all four projections, tied head, the second layer windowed.
build("qwen3_qk_norm", "qwen3", 19, num_key_value_heads=2, head_dim=16, attention_bias=True,
      tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
      max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
      **common)
# Every second layer without rotation (NoPE), GQA, tied head.
build("smollm3_nope", "smollm3", 20, num_key_value_heads=2, no_rope_layer_interval=2,
      tie_word_embeddings=True, pad_token_id=0,
      **{**common, "num_hidden_layers": 4})
# Norms on the outputs of attention and MLP, q/k RMSNorm over the whole projections, GQA.
build("olmo2_post_norm", "olmo2", 21, num_key_value_heads=2, tie_word_embeddings=False,
      pad_token_id=0, **common)
# Multipliers on embeddings, scores, residual branches and logits, GQA, biases.
build("granite_multipliers", "granite", 22, num_key_value_heads=2, attention_bias=True,
      mlp_bias=True, embedding_multiplier=4.0, attention_multiplier=0.2,
      residual_multiplier=0.5, logits_scaling=3.0, tie_word_embeddings=True, **common)
# LongRoPE (Phi-3's): an original context of 8 within 64, so the full pass (T = 12) takes
# the long factors and its first 8 positions alone the short ones; the greedy continuation
# of 5 ids crosses from one to the other. logits_short: the first 8 ids alone.
built = build("llama_longrope", "llama", 24, num_key_value_heads=2, tie_word_embeddings=False,
              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                               "original_max_position_embeddings": 8,
                               "short_factor": [1.0, 1.5, 2.0, 3.0],
                               "long_factor": [1.0, 4.0, 9.0, 16.0]}, **common)
if built is not None:
    model, input_ids, out = built
    path = os.path.join(out, "expected.safetensors")
    from safetensors.torch import load_file
    exp = load_file(path)
    with torch.no_grad():
        exp["logits_short"] = model(input_ids[:, :8]).logits.float().contiguous()
    save_file(exp, path)
# Phi-3: q/k/v and gate/up stored fused, a window of 5 on every layer, GQA, untied head.
build("phi3_window", "phi3", 25, num_key_value_heads=2, sliding_window=5,
      tie_word_embeddings=False, pad_token_id=0,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **common)
# Phi-4-mini's parts: partial rotary (0.75 of each head: 3 frequencies), LongRoPE with an
# original context of 8 within 64, tied head. Read by the LongRoPE test (its greedy
# continuation crosses the original context).
built = build("phi4_longrope", "phi3", 26, num_key_value_heads=2, tie_word_embeddings=True,
              original_max_position_embeddings=8,
              pad_token_id=0,
              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.75,
                               "original_max_position_embeddings": 8,
                               "short_factor": [1.0, 2.0, 3.0],
                               "long_factor": [1.5, 6.0, 20.0]}, **common)
if built is not None:
    model, input_ids, out = built
    path = os.path.join(out, "expected.safetensors")
    from safetensors.torch import load_file
    exp = load_file(path)
    with torch.no_grad():
        exp["logits_short"] = model(input_ids[:, :8]).logits.float().contiguous()
    save_file(exp, path)
# LFM2: convolution blocks (3 taps) around attention blocks with per-head q/k norms, GQA,
# tied head; the MLP width derived from intermediate_size (2/3 of 72, rounded up to 16).
build("lfm2_hybrid", "lfm2", 27, num_key_value_heads=2,
      block_multiple_of=16, layer_types=["conv", "full_attention", "conv", "conv"],
      conv_L_cache=3, **{**common, "num_hidden_layers": 4, "intermediate_size": 72})
# LFM2 with biases on the convolution and its projections, 4 taps, attention first and
# last, the MLP width as given (no auto-adjustment), untied head.
build("lfm2_conv_bias", "lfm2", 28, num_key_value_heads=1, conv_bias=True, conv_L_cache=4,
      block_auto_adjust_ff_dim=False, tie_word_embeddings=False,
      layer_types=["full_attention", "conv", "conv", "full_attention"],
      **{**common, "num_hidden_layers": 4})
# Gemma 3: sandwich norms, per-head q/k norms, GeGLU, heads of 16 over a width of 32,
# every second layer global (window 4 < T on the others), the local layers at base 100 and
# the global ones at 10000 with linear scaling, scores by query_pre_attn_scalar 24,
# soft-capped logits, tied head.
build("gemma3_local_global", "gemma3_text", 23, num_key_value_heads=2, head_dim=16,
      sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=24,
      final_logit_softcapping=3.0, pad_token_id=0,
      rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                          "factor": 2.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
      **{**common, "num_hidden_layers": 4})
# Gemma 2: Gemma 3's sandwich norms, GeGLU and scaled embeddings without q/k norms,
# alternate layers windowed (4 < T), scores by query_pre_attn_scalar 24 and soft-capped at 2
# (small enough that the cap bends most scores), logits capped at 3, GQA, tied head.
build("gemma2_softcap", "gemma2", 29, num_key_value_heads=2, head_dim=16, sliding_window=4,
      query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
      pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
      **{**common, "num_hidden_layers": 4})
if ONLY and "llama_tokenizer" not in ONLY:
    sys.exit(0)


# A SentencePiece-style BPE with byte fallback, as Llama's and TinyLlama's tokenizers are
# (Metaspace pre-tokenizer, <0xNN> byte tokens, a template that adds <s>), trained on a few
# sentences, and a Llama-layout model over its vocabulary. transformers 5 adds BOS when
# tokenizer.json's post-processor says so (it ignores tokenizer_config.json's add_bos_token:
# checked with 5.23), so this records what `tokenizer(text)` gives.
TEXT = ("The quick brown fox jumps over the lazy dog. Now is the winter of our discontent "
        "made glorious summer by this sun of York. Zwölf Boxkämpfer jagen Viktor quer über "
        "den großen Sylter Deich. ") * 8
bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                 decoders.Fuse(), decoders.Strip(" ", 1, 0)])
bytes_ = [f"<0x{i:02X}>" for i in range(256)]
bpe.train_from_iterator([TEXT], trainers.BpeTrainer(
    vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"] + bytes_, show_progress=False))
tmp = os.path.join(ROOT, "tokenizer.tmp.json")
bpe.save(tmp)
tok = LlamaTokenizer(tokenizer_file=tmp, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                     add_bos_token=True)
os.remove(tmp)
build("llama_tokenizer", "llama", 18, tokenizer=tok, vocab_size=len(tok), hidden_size=32,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
out = os.path.join(ROOT, "llama_tokenizer")
tok = AutoTokenizer.from_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
cases = []
for prompt in ["The quick brown fox", "Zwölf Boxkämpfer 🙂 über"]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
                             eos_token_id=None, output_scores=True,
                             return_dict_in_generate=True)
        loss = model(ids, labels=ids).loss.item()
    new = gen.sequences[0, ids.shape[1]:].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
    cases.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "new_ids": new,
                  "text": tok.decode(new), "loss": loss, "margins": margins})
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump(cases, f, indent=1, ensure_ascii=False)
print("llama_tokenizer:", [c["prompt_ids"][:3] for c in cases])
