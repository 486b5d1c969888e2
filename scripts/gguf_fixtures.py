"""GGUF files made by llama.cpp's own converter, what transformers and llama.cpp compute
with them, a tokenizer corpus, and real chat templates rendered by transformers. Read by
crates/block/tests/gguf.rs and crates/cli/tests/chat.rs.

llama.cpp comes from the package registry: the `llama-cpp-python` source package vendors a
full llama.cpp tree (convert_hf_to_gguf.py, gguf-py, the chat templates of real models in
models/templates/), and building it gives the `llama_cpp` module used for the reference
logits and for quantizing (q4_0, q4_K_M) with llama.cpp's own quantizer:

    python3 -m venv /tmp/ref
    /tmp/ref/bin/pip install torch transformers safetensors tokenizers numpy sentencepiece protobuf jinja2
    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/ref/bin/pip install /tmp/lcp/llama_cpp_python-0.3.36.tar.gz
    LLAMA_CPP=/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp /tmp/ref/bin/python scripts/gguf_fixtures.py [name ...]

(A llama.cpp built from the same tree by cmake serves too: `pip install diskcache`, then
LLAMA_CPP_LIB_PATH=<its bin/> PYTHONPATH=/tmp/lcp/llama_cpp_python-0.3.36.) With names,
only those models are (re)written.

Models (random weights, every parameter redrawn so that a dropped or swapped part shows):
- gpt2: byte-level BPE tokenizer, learned positions, fused Conv1D attention;
- llama: SentencePiece BPE tokenizer with byte fallback (tokenizer.model, so the converter
  writes real scores), grouped-query attention, untied head; the converter permutes q/k
  for llama.cpp's rotary layout, which the loader must undo;
- qwen2: byte-level BPE, q/k/v biases, tied head;
- neox: byte-level BPE, rotary on a quarter of each head, parallel residual;
- llama3: Llama 3.1's "llama3" RoPE scaling (the converter stores it as `rope_freqs`); its
  checkpoint is kept too (llama3_hf/) for the config.json path;
- llama_wide: width 256 so that every matrix takes the k-quants (rows of 256);
- qwen3: q/k RMSNorm per head, heads of 32 over a width of 64 (wider than 64 / 4), tied;
- smollm3: four layers, the fourth without rotation (llama.cpp's fixed NoPE step of 4);
  the converter permutes q/k as for Llama;
- olmo2: norms after attention and MLP, q/k RMSNorm over the whole projection;
- granite: embedding, attention, residual and logit multipliers; q/k permuted as Llama's;
- gemma3: six layers, the sixth global and the others windowed (window 4, llama.cpp's
  fixed period of 6), local and global bases 100 and 1000, sandwich norms (the converter
  adds Gemma's 1 to them), per-head q/k norms, heads of 32 over a width of 64, one kv
  head, query_pre_attn_scalar equal to the head width (llama.cpp fixes it so),
  soft-capped logits; Gemma 3's chat template (the chat fixtures' copy of it), which folds
  the system turn into the first user turn;
- gemma2: the Llama's SentencePiece tokenizer (the converter reads tokenizer.model), four
  layers alternating windowed (window 4) and global, attention scores
  soft-capped at 2 and logits at 5, sandwich norms, heads of 32 over a width of 64, one kv
  head, query_pre_attn_scalar equal to the head width (llama.cpp fixes it so);
- phi4_mini (phi3): Phi-4-mini's parts: q/k/v and gate/up fused as stored, 0.75 of each head rotated,
  LongRoPE (a context of 131072 over 4096: attention factor 1.19; the sample stays within
  the original context, where transformers and llama.cpp both take the short factors), tied;
- lfm2: four layers, the second attention (per-head q/k norms) and the others gated short
  convolutions of 3 taps (llama.cpp marks them by zero key/value heads).
Per model, in crates/block/tests/fixtures/gguf/: NAME.f32.gguf and NAME.q8_0.gguf
(convert_hf_to_gguf.py --outtype), NAME.q4_0.gguf / NAME.q4_k_m.gguf (llama.cpp's
quantizer: q4_1, q5_0 and q5_1 on the Llama; q2_k and q3_k_m on llama_wide: with q4_k_m they hold
Q2_K, Q3_K, Q4_K, Q5_K and Q6_K tensors),
NAME.tokenizer.json, and NAME.expected.safetensors:
- input_ids [T] (i64): the sample text as transformers' tokenizer encodes it
- logits [T, vocab]: transformers' model(input_ids).logits (f32)
- llama_<kind>_logits [T, vocab]: llama.cpp's logits on the same ids from each GGUF file
  (logits_all, f32 KV cache)
- llama_<kind>_greedy [N] and llama_<kind>_margins [N]: llama.cpp's greedy continuation of
  the first P ids and the top-1 minus top-2 logit at each step
The byte-level BPE tokenizers are trained here and have no hub hash for the converter's
pre-tokenizer detection; they split text as GPT-2 does, so the converter is told "gpt-2".

tokenizer_corpus.json: 1,200 strings (Unicode, emoji, runs of spaces and newlines, digits,
special tokens), part of the larger corpus of scripts/sentencepiece_fixtures.py.

(The chat template fixtures are scripts/chat_template_fixtures.py's.)
"""

import json
import os
import random
import runpy
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
ONLY = set(sys.argv[1:])
OUT = os.path.join(HERE, "..", "crates", "block", "tests", "fixtures", "gguf")
LLAMA_CPP = os.environ.get("LLAMA_CPP", "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
SAMPLE = "ROMEO: But soft, what light through yonder window breaks? It is the east, and 42."
PROMPT = 8  # ids of the sample the greedy continuations start from
NEW = 12


def corpus():
    """Strings that exercise a tokenizer: the same list every run."""
    rng = random.Random(7)
    pieces = [
        "Hello world", "hello  world", " leading", "trailing ", "\n", "\n\n", "\t", "  ",
        "   ", "\r\n", "naïve café", "Ünïcödé", "日本語のテキスト", "中文", "한국어", "Привет, мир",
        "مرحبا", "שלום", "🚀", "😶‍🌫️", "🦙🦙", "👍🏽", "3", "33", "333", "3.14159", "1,000,000",
        "2026-11-23", "0x1F", "I've", "we'll", "'RE", "don't", "!!!", "...", "?!", "«»", "—",
        "<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "ROMEO:",
        "But soft", "what light", "through yonder", "window breaks", "x" * 40, "ab" * 17,
        "    indented code()", "def f(x):\n    return x", "a\u00a0b", "\u200b", "e\u0301",
    ]
    out = list(pieces)
    while len(out) < 1200:
        n = rng.randint(1, 6)
        parts = [rng.choice(pieces) for _ in range(n)]
        sep = rng.choice(["", " ", "  ", "\n", " \n ", "\t"])
        out.append(sep.join(parts))
    return out


def perturb(model, seed):
    """Every matrix at std 1/sqrt(fan_in), norms 1 + 0.1·noise, biases 0.1·noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1] if "c_" not in name else p.shape[0]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            elif "norm" in name or "ln_" in name:
                # Gemma's RMSNorm multiplies by 1 + w: its w near 0.
                shift = 0.0 if model.config.model_type in ("gemma2", "gemma3_text") else 1.0
                p.copy_(shift + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def bpe_tokenizer(text, vocab_size):
    """A byte-level BPE trained on `text`, GPT-2's pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def spm_tokenizer(text, vocab_size, work):
    """A SentencePiece BPE with byte fallback, as Llama 2 / TinyLlama ship it: the
    tokenizer.model the converter reads, and the tokenizer.json transformers makes of it."""
    import sentencepiece as spm
    path = os.path.join(work, "train.txt")
    with open(path, "w") as f:
        f.write(text)
    prefix = os.path.join(work, "spm")
    spm.SentencePieceTrainer.train(
        input=path, model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, bos_id=1, eos_id=2,
        unk_id=0, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity")
    # transformers converts tokenizer.model into its own tokenizer (tokenizer.json).
    tok_dir = os.path.join(work, "spm_tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    shutil.copy(prefix + ".model", os.path.join(tok_dir, "tokenizer.model"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": True, "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}, f)
    return AutoTokenizer.from_pretrained(tok_dir), prefix + ".model"


def convert(src, dst, outtype):
    """llama.cpp's convert_hf_to_gguf.py, in this process so that the BPE pre-tokenizer
    hash check can be answered for the tokenizers trained here."""
    sys.path.insert(0, LLAMA_CPP)
    sys.path.insert(0, os.path.join(LLAMA_CPP, "gguf-py"))
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    # The converter reads hparams through AutoConfig, which in transformers 5 drops the
    # older field names it still asks for (NeoX's rotary_pct); config.json has them.
    if not hasattr(base.ModelBase, "_plain_load_hparams"):
        base.ModelBase._plain_load_hparams = base.ModelBase.load_hparams

        def load_hparams(dir_model, is_mistral_format):
            cfg = base.ModelBase._plain_load_hparams(dir_model, is_mistral_format)
            with open(os.path.join(dir_model, "config.json")) as f:
                for k, v in json.load(f).items():
                    cfg.setdefault(k, v)
            return cfg
        base.ModelBase.load_hparams = staticmethod(load_hparams)
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", dst, "--outtype", outtype]
    try:
        runpy.run_path(os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = argv


def quantize(src, dst, ftype):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    assert rc == 0, f"llama_model_quantize failed: {rc}"


def llama_cpp_run(path, ids):
    """llama.cpp's logits for every position, and its greedy continuation of ids[:PROMPT]."""
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=128, n_threads=2, logits_all=True, verbose=False,
                type_k=0, type_v=0, n_batch=128, n_ubatch=128)  # f32 KV cache
    llm.eval(list(ids))
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.reset()
    llm.eval(list(ids[:PROMPT]))
    greedy, margins = [], []
    for _ in range(NEW):
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.sort(last)[-2:]
        tok = int(np.argmax(last))
        greedy.append(tok)
        margins.append(float(top[1] - top[0]))
        llm.eval([tok])
    del llm
    return torch.from_numpy(logits), torch.tensor(greedy), torch.tensor(margins)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def build(name, family, tokenizer, seed, work, kinds, chat_template=None, keep_hf=False, **kw):
    if ONLY and name not in ONLY:
        return
    cfg = AutoConfig.for_model(family, vocab_size=len(tokenizer), **kw)
    tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    perturb(model, seed)
    src = os.path.join(work, name)
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    # The converter still reads the field names of the hub's older files, which
    # transformers 5 no longer writes: GPT-2's n_ctx, NeoX's rotary_pct/rotary_emb_base.
    path = os.path.join(src, "config.json")
    c = json.load(open(path))
    if family == "gpt2":
        c["n_ctx"] = c["n_positions"]
    if family == "gpt_neox":
        c["rotary_pct"] = c["rope_parameters"]["partial_rotary_factor"]
        c["rotary_emb_base"] = c["rope_parameters"]["rope_theta"]
    json.dump(c, open(path, "w"), indent=2)
    if family == "phi3":
        # Phi-4-mini's files name a GPT-2 tokenizer, which the converter reads as BPE.
        tpath = os.path.join(src, "tokenizer_config.json")
        t = json.load(open(tpath))
        t["tokenizer_class"] = "GPT2Tokenizer"
        json.dump(t, open(tpath, "w"), indent=2)
    ids = tokenizer(SAMPLE)["input_ids"]
    print(f"{name}: {len(ids)} sample ids")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    expected = {"input_ids": torch.tensor(ids), "logits": logits.contiguous()}
    if chat_template is not None:
        # What `gpt generate --chat` must feed the model for CHAT.
        chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
            chat_ids = chat_ids["input_ids"]
        expected["chat_ids"] = torch.tensor(chat_ids)
    shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(OUT, f"{name}.tokenizer.json"))
    if keep_hf:
        # The checkpoint itself, for the config.json path.
        os.makedirs(os.path.join(OUT, f"{name}_hf"), exist_ok=True)
        for f in ["config.json", "model.safetensors"]:
            shutil.copy(os.path.join(src, f), os.path.join(OUT, f"{name}_hf", f))
    files = {}
    for kind in kinds:
        dst = os.path.join(OUT, f"{name}.{kind}.gguf")
        if kind in ("f32", "q8_0"):
            convert(src, dst, kind)
        else:
            import llama_cpp
            f32 = os.path.join(work, f"{name}.f32.gguf")
            if not os.path.exists(f32):
                convert(src, f32, "f32")
            ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
            quantize(f32, dst, ftype)
        files[kind] = dst
    for kind, path in files.items():
        lg, greedy, margins = llama_cpp_run(path, ids)
        expected[f"llama_{kind}_logits"] = lg
        expected[f"llama_{kind}_greedy"] = greedy
        expected[f"llama_{kind}_margins"] = margins
        print(f"{name}.{kind}: {os.path.getsize(path)} bytes; llama.cpp vs transformers max |dlogit| "
              f"{(lg - logits).abs().max().item():.3g}")
    save_file(expected, os.path.join(OUT, f"{name}.expected.safetensors"))


def gguf_models():
    os.makedirs(OUT, exist_ok=True)
    strings = corpus()
    if not ONLY:
        with open(os.path.join(OUT, "tokenizer_corpus.json"), "w") as f:
            json.dump(strings, f, ensure_ascii=False, indent=0)
    import this  # noqa: F401  (the Zen of Python: a few hundred words of English)
    zen = "".join(this.d.get(c, c) for c in this.s)
    text = "\n".join([zen, SAMPLE] + strings[:400]) * 3
    work = tempfile.mkdtemp()
    bpe = bpe_tokenizer(text, 320)
    spm_tok, spm_model = spm_tokenizer(text, 640, work)
    small = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 intermediate_size=128, max_position_embeddings=128)

    build("gpt2", "gpt2", bpe, 1, work, ["f32", "q8_0"], n_embd=64, n_head=4, n_layer=2,
          n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
          bos_token_id=0, eos_token_id=0)

    def with_spm(name):
        # The converter reads tokenizer.model for the SentencePiece scores.
        src = os.path.join(work, name)
        os.makedirs(src, exist_ok=True)
        shutil.copy(spm_model, os.path.join(src, "tokenizer.model"))

    with_spm("llama")
    build("llama", "llama", spm_tok, 2, work, ["f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"],
          chat_template=ZEPHYR,
          num_key_value_heads=2,
          tie_word_embeddings=False, rope_theta=500.0, bos_token_id=1, eos_token_id=2, **small)
    build("qwen2", "qwen2", bpe, 3, work, ["f32", "q8_0", "q4_0"], num_key_value_heads=2,
          tie_word_embeddings=True, rope_theta=1000.0, bos_token_id=0, eos_token_id=0,
          use_sliding_window=False, **small)
    build("neox", "gpt_neox", bpe, 4, work, ["f32", "q8_0"], rotary_pct=0.25,
          use_parallel_residual=True, bos_token_id=0, eos_token_id=0, **small)
    with_spm("llama3")
    # Llama 3.1's "llama3" RoPE scaling, with a short original context so that the bands
    # split the frequencies of a 16-wide head (the converter writes it as rope_freqs).
    build("llama3", "llama", spm_tok, 6, work, ["f32"], keep_hf=True, num_key_value_heads=2,
          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
          rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}, **small)
    with_spm("llama_wide")
    build("llama_wide", "llama", spm_tok, 5, work, ["q2_k", "q3_k_m", "q4_k_m"],
          hidden_size=256,
          num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
          intermediate_size=512, max_position_embeddings=128, tie_word_embeddings=False,
          bos_token_id=1, eos_token_id=2)
    build("qwen3", "qwen3", bpe, 7, work, ["f32", "q8_0", "q4_0"], num_key_value_heads=2,
          head_dim=32, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
          rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **small)
    build("smollm3", "smollm3", bpe, 8, work, ["f32", "q8_0"], num_key_value_heads=2,
          tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
          **{**small, "num_hidden_layers": 4})
    build("olmo2", "olmo2", bpe, 9, work, ["f32", "q8_0"], num_key_value_heads=2,
          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, **small)
    build("granite", "granite", bpe, 10, work, ["f32", "q8_0"], num_key_value_heads=2,
          embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5,
          logits_scaling=3.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
          pad_token_id=0, **small)
    build("gemma3", "gemma3_text", bpe, 11, work, ["f32", "q8_0", "q4_0"], chat_template=GEMMA3,
          num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
          sliding_window_pattern=6, final_logit_softcapping=5.0, tie_word_embeddings=True,
          bos_token_id=0, eos_token_id=0, pad_token_id=0,
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
          **{**small, "num_hidden_layers": 6})
    # llama.cpp's Gemma 2 converter reads a SentencePiece tokenizer.model.
    with_spm("gemma2")
    build("gemma2", "gemma2", spm_tok, 17, work, ["f32", "q8_0", "q4_0"],
          num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
          attn_logit_softcapping=2.0, final_logit_softcapping=5.0, tie_word_embeddings=True,
          bos_token_id=1, eos_token_id=2, pad_token_id=0,
          # Gemma 2's own base: the converter writes no rope.freq_base for it, and llama.cpp
          # then takes 10000.
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
          **{**small, "num_hidden_layers": 4})
    build("phi4_mini", "phi3", bpe, 13, work, ["f32", "q8_0", "q4_0"], num_key_value_heads=2,
          tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
          original_max_position_embeddings=4096,
          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.75,
                           "original_max_position_embeddings": 4096,
                           "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                           "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
          **{**small, "max_position_embeddings": 131072})
    build("lfm2", "lfm2", bpe, 12, work, ["f32", "q8_0", "q4_0"], num_key_value_heads=2,
          layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3,
          block_multiple_of=32, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
          pad_token_id=0, **{**small, "num_hidden_layers": 4, "intermediate_size": 192})


ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + "
          "message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ "
          "'<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == "
          "'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif "
          "%}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif "
          "%}\n{% endfor %}")
# Gemma 3's template, as scripts/chat_template_fixtures.py copied it from transformers.
GEMMA3 = open(os.path.join(HERE, "..", "crates", "cli", "tests", "fixtures", "chat", "templates",
                           "google-gemma-3-it.jinja"), encoding="utf-8").read()

if __name__ == "__main__":
    gguf_models()
