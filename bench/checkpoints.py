"""Checkpoints with random weights that the benchmarks share (made by transformers, not
committed): GPT-2 124M, or SmolLM-135M's Llama geometry (30 layers, width 576, 9 heads over
3 key/value heads, MLP 1536, vocabulary 49152, tied embeddings)."""
import os

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

DEFAULT_DIRS = {"gpt2": "/tmp/gpt2-124m-random", "llama": "/tmp/smollm-135m-random"}


def random_checkpoint(arch, path=None):
    """Makes the checkpoint in `path` (default DEFAULT_DIRS[arch]) unless it is there."""
    path = path or DEFAULT_DIRS[arch]
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        if arch == "gpt2":
            GPT2LMHeadModel(GPT2Config()).save_pretrained(path, safe_serialization=True)
        else:
            cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, max_position_embeddings=2048,
                              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
                              eos_token_id=0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path,
                                                                  safe_serialization=True)
    return path
