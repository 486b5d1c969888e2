"""Checkpoints with random weights that the benchmarks share (made by transformers, not
committed): GPT-2 124M; SmolLM-135M's Llama geometry (30 layers, width 576, 9 heads over
3 key/value heads, MLP 1536, vocabulary 49152, tied embeddings); Qwen3-0.6B's (28 layers,
width 1024, 16 heads over 8, head 128, MLP 3072, vocabulary 151936, tied); Gemma-3-270M's
(18 layers, width 640, 4 heads over 1, head 256, MLP 2048, vocabulary 262144, tied,
window 512 on five layers of six)."""
import os

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig)

DEFAULT_DIRS = {"gpt2": "/tmp/gpt2-124m-random", "llama": "/tmp/smollm-135m-random",
                "qwen3": "/tmp/qwen3-0.6b-random", "gemma3": "/tmp/gemma3-270m-random"}


def random_checkpoint(arch, path=None):
    """Makes the checkpoint in `path` (default DEFAULT_DIRS[arch]) unless it is there."""
    path = path or DEFAULT_DIRS[arch]
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        if arch == "gpt2":
            GPT2LMHeadModel(GPT2Config()).save_pretrained(path, safe_serialization=True)
        elif arch == "qwen3":
            cfg = AutoConfig.for_model(
                "qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path,
                                                                  safe_serialization=True)
        elif arch == "gemma3":
            cfg = AutoConfig.for_model(
                "gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                head_dim=256, max_position_embeddings=32768, sliding_window=512,
                sliding_window_pattern=6, query_pre_attn_scalar=256,
                tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path,
                                                                  safe_serialization=True)
        else:
            cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, max_position_embeddings=2048,
                              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
                              eos_token_id=0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path,
                                                                  safe_serialization=True)
    return path
