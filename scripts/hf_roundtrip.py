"""Checks that checkpoints written by `block::save_dir` (GPT-2, Llama, Qwen3, SmolLM3, OLMo 2,
Granite, Phi-3, Mistral, Qwen2, Gemma 2, Gemma 3 and LFM2 directories) load
in transformers and give our logits. Run it after changing the writer:

    /tmp/ref/bin/python scripts/hf_roundtrip.py

For each fixture (GPT-2 Hugging Face directories, the nanoGPT ckpt.pt, the Llama ones) and
the built-in model written by `gpt train`, the `resave` example loads it, saves it as a
Hugging Face directory and records our logits; transformers'
AutoModelForCausalLM.from_pretrained then loads that directory (GPT2LMHeadModel or
LlamaForCausalLM, by its config.json). Exits non-zero when any logit differs by more than
1e-4.
"""
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIX = os.path.join(ROOT, "crates", "block", "tests", "fixtures")
sources = [os.path.join(FIX, n) for n in ("tiny", "inverse_layer_scale", "untied_exact_gelu")]
sources.append(os.path.join(FIX, "nanogpt", "ckpt.pt"))
# Llama: q/k/v/o biases with grouped heads; one key/value head with linear RoPE scaling.
sources += [os.path.join(FIX, "families", n) for n in ("llama_gqa_bias", "llama_mqa_linear")]
# The families in Llama's layout: q/k norms and a window (Qwen3), layers without rotation
# (SmolLM3), norms after the branches (OLMo 2), multipliers (Granite).
sources += [os.path.join(FIX, "families", n)
            for n in ("qwen3_qk_norm", "smollm3_nope", "olmo2_post_norm", "granite_multipliers")]
# Gemma 2 and 3: sandwich norms stored as `w` for `1 + w`, windows by layer type, soft caps,
# and Gemma 3's two rotations.
sources += [os.path.join(FIX, "families", n) for n in ("gemma2_softcap", "gemma3_local_global")]
# LFM2: convolution blocks between attention blocks, with and without the convolution's bias.
sources += [os.path.join(FIX, "families", n) for n in ("lfm2_hybrid", "lfm2_conv_bias")]
# Phi-3: q/k/v and gate/up fused again as stored; a window; Phi-4-mini's partial rotary and
# LongRoPE.
sources += [os.path.join(FIX, "families", n) for n in ("phi3_window", "phi4_longrope")]
# Mistral's window on every layer; Qwen2's q/k/v biases and windowed layers.
sources += [os.path.join(FIX, "families", n) for n in ("mistral_window", "qwen2_bias_window")]
# The built-in model, trained and saved by `gpt train` (f16 weights).
sources.append(os.path.join(ROOT, "crates", "cli", "models", "default"))
worst = 0.0
with tempfile.TemporaryDirectory() as tmp:
    for i, src in enumerate(sources):
        out = os.path.join(tmp, str(i))
        subprocess.run(["cargo", "run", "-q", "-p", "gpt-blocks", "--example", "resave", "--", src, out],
                       cwd=ROOT, check=True)
        ours = load_file(os.path.join(out, "ours.safetensors"))
        # Eager attention: the plain reference (Gemma 2's soft-capped scores need it).
        model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(model).__name__ in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM",
                                    "SmolLM3ForCausalLM", "Olmo2ForCausalLM",
                                    "GraniteForCausalLM", "Gemma2ForCausalLM",
                                    "Gemma3ForCausalLM", "Lfm2ForCausalLM",
                                    "Phi3ForCausalLM", "MistralForCausalLM",
                                    "Qwen2ForCausalLM"), type(model)
        with torch.no_grad():
            theirs = model(ours["input_ids"]).logits
        diff = (theirs - ours["logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"{os.path.relpath(src, ROOT)} ({type(model).__name__}): max |logit diff| {diff:.3e}")
print(f"worst {worst:.3e}")
sys.exit(0 if worst <= 1e-4 else 1)
