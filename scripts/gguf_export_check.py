"""Checks that GGUF files written by `gpt convert` run in llama.cpp as they run in gpt:
for each model and format, llama.cpp (the `llama_cpp` module of the llama-cpp-python source
package, built as scripts/gguf_fixtures.py says) loads the file, tokenizes a prompt into the
ids gpt gives, and continues it greedily with the tokens gpt picks.

    cargo build --release --bin gpt
    /tmp/ref/bin/python scripts/gguf_export_check.py

Models: the built-in one (GPT-2 layout, trained by `gpt train`) and the GGUF fixtures of
crates/block/tests/fixtures/gguf/ (Llama, Qwen2, GPT-NeoX, GPT-2, Llama with Llama 3.1's RoPE
scaling, Qwen3, SmolLM3, OLMo 2, Granite, Gemma 2, Gemma 3, LFM2, Phi-4-mini), re-exported.
Prints one line per file and exits non-zero on any difference. With names, only those.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from llama_cpp import Llama

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GPT = os.path.join(ROOT, "target", "release", "gpt")
FIX = os.path.join(ROOT, "crates", "block", "tests", "fixtures", "gguf")
PROMPT = "ROMEO: But soft, what light"
NEW = 16


def gpt(*args):
    out = subprocess.run([GPT, *args], check=True, capture_output=True, text=True)
    return out.stdout


def llama_greedy(path, ids):
    llm = Llama(model_path=path, n_ctx=128, n_threads=2, logits_all=True, verbose=False,
                type_k=0, type_v=0)
    llm.eval(ids)
    new, margins = [], []
    for _ in range(NEW):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.sort(logits)[-2:]
        tok = int(np.argmax(logits))
        new.append(tok)
        margins.append(float(top[1] - top[0]))
        llm.eval([tok])
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    return new, margins, tokens


def main():
    work = tempfile.mkdtemp()
    sources = [(None, "builtin")] + [(os.path.join(FIX, f"{n}.f32.gguf"), n)
                                     for n in ["llama", "qwen2", "neox", "gpt2", "llama3",
                                               "qwen3", "smollm3", "olmo2", "granite",
                                               "gemma2", "gemma3", "lfm2", "phi4_mini"]]
    only = set(sys.argv[1:])
    if only:
        sources = [s for s in sources if s[1] in only]
    failed = False
    for src, name in sources:
        for kind in ["f32", "f16", "q8_0", "q4_0"]:
            out = os.path.join(work, f"{name}.{kind}.gguf")
            model = ["--model", src] if src else []
            gpt(*model, "convert", "--out", out, "--type", kind)
            res = json.loads(gpt("--model", out, "generate", "--prompt", PROMPT, "--temperature", "0",
                                 "--max-new-tokens", str(NEW), "--format", "json"))
            ours_ids, ours_new = res["prompt_ids"], res["new_ids"]
            theirs_new, margins, theirs_ids = llama_greedy(out, ours_ids)
            # Steps after a near-tie of llama.cpp's top two logits may differ by rounding.
            upto = next((i for i, m in enumerate(margins) if m < 1e-2), NEW)
            same_ids = ours_ids == theirs_ids
            same_new = ours_new[:upto] == theirs_new[:upto]
            ok = same_ids and same_new
            failed |= not ok
            first = next((i for i in range(upto) if ours_new[i] != theirs_new[i]), None)
            where = "" if first is None else f"; first difference at step {first}, llama.cpp's top-two margin there {margins[first]:.3g}"
            print(f"{name}.{kind}: {'ok' if ok else 'DIFFERENT'}: prompt ids "
                  f"{'equal' if same_ids else f'{ours_ids} vs {theirs_ids}'}, greedy tokens "
                  f"{'equal' if same_new else f'{ours_new} vs {theirs_new}'} ({upto} of {NEW} compared{where})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
