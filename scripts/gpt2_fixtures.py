"""Small GPT-2 checkpoints with random weights, and what Hugging Face transformers computes
with them. Read by crates/block/tests/hf_reference.rs.

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers safetensors
    /tmp/ref/bin/python scripts/gpt2_fixtures.py

For each model, crates/block/tests/fixtures/<name>/ gets what `save_pretrained` writes
(config.json, model.safetensors) and expected.safetensors:
- input_ids [2, T] (i64), logits [2, T, vocab] (f32): GPT2LMHeadModel(input_ids).logits
- loss (f32 scalar): GPT2LMHeadModel(input_ids, labels=input_ids).loss
- prompt [1, P], greedy [1, N]: generate(do_sample=False, max_new_tokens=N) new tokens
- margins [N]: top-1 minus top-2 logit at each greedy step (near ties may be skipped)
"""

import os

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.join(os.path.dirname(__file__), "..", "crates", "block", "tests", "fixtures")


def build(name, seed, **cfg):
    torch.manual_seed(seed)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **cfg)
    model = GPT2LMHeadModel(config).eval()
    # Default init leaves biases at 0 and LayerNorms at 1/0, which would hide a loader that
    # drops or swaps them.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.add_(0.05 * torch.randn_like(p))
            elif "ln" in pname and pname.endswith("weight"):
                p.add_(0.1 * torch.randn_like(p))
    out = os.path.join(ROOT, name)
    model.save_pretrained(out, safe_serialization=True)

    vocab, n_pos = config.vocab_size, config.n_positions
    t = min(12, n_pos)
    input_ids = torch.randint(0, vocab, (2, t))
    with torch.no_grad():
        logits = model(input_ids).logits
        loss = model(input_ids[:1], labels=input_ids[:1]).loss
        prompt = torch.randint(0, vocab, (1, 5))
        n_new = min(10, n_pos - 5)
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        greedy = gen.sequences[:, prompt.shape[1]:]
        margins = torch.stack([s[0].topk(2).values[0] - s[0].topk(2).values[1] for s in gen.scores])
    save_file({
        "input_ids": input_ids.contiguous(),
        "logits": logits.float().contiguous(),
        "loss": loss.float().reshape(()),
        "prompt": prompt.contiguous(),
        "greedy": greedy.contiguous(),
        "margins": margins.float().contiguous(),
    }, os.path.join(out, "expected.safetensors"))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {loss.item():.6f}")


build("tiny", 1, vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
build("inverse_layer_scale", 2, vocab_size=80, n_positions=24, n_embd=24, n_layer=3, n_head=2,
      scale_attn_by_inverse_layer_idx=True)
build("untied_exact_gelu", 3, vocab_size=64, n_positions=20, n_embd=16, n_layer=1, n_head=1,
      n_inner=40, activation_function="gelu", tie_word_embeddings=False)


def nanogpt(name, seed):
    """A nanoGPT `ckpt.pt` (bias=False, saved from a torch.compile'd model: `_orig_mod.`
    prefix, nn.Linear [out, in] weights, exact GELU, tied head) and the logits of the same
    weights in transformers' GPT2LMHeadModel with every bias zeroed."""
    torch.manual_seed(seed)
    args = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, bias=False, vocab_size=40, dropout=0.0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    sd = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.zero_()
                continue
            if "ln" in pname:
                p.add_(0.1 * torch.randn_like(p))
            # Conv1D [in, out] -> nn.Linear [out, in]
            conv = any(pname.endswith(f"{m}.weight") for m in ("c_attn", "c_proj", "c_fc"))
            sd["_orig_mod." + pname] = (p.t() if conv else p).contiguous().clone()
        sd["_orig_mod.lm_head.weight"] = sd["_orig_mod.transformer.wte.weight"]
    out = os.path.join(ROOT, name)
    os.makedirs(out, exist_ok=True)
    torch.save({"model": sd, "model_args": args, "iter_num": 5, "best_val_loss": torch.tensor(2.5),
                "config": {"dataset": "shakespeare_char"}}, os.path.join(out, "ckpt.pt"))
    input_ids = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        logits = model(input_ids).logits
    save_file({"input_ids": input_ids, "logits": logits.contiguous()},
              os.path.join(out, "expected.safetensors"))
    print(f"{name}: nanoGPT checkpoint")


nanogpt("nanogpt", 4)
