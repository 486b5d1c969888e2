"""Tokenizer references over one corpus: SentencePiece BPE vocabularies as GGUF files and
what SentencePiece makes of the corpus; and what transformers' AutoTokenizer makes of it with
the byte-level BPE fixtures' tokenizer.json.

Trains small BPE models with the `sentencepiece` library, converts each to a vocabulary-only
GGUF file with llama.cpp's own converter, and records what `SentencePieceProcessor` gives for
every string of a generated corpus of 5,000+ strings (ids, and the text `decode` gives back),
and for random id sequences (`decode`). The Rust test
(crates/cli/src/text/sentencepiece.rs) reads the GGUF files and must give the same.

The byte-level BPE vocabularies of crates/block/tests/fixtures/gguf (GPT-2's pre-tokenizer,
Qwen2's) were written by llama.cpp's converter from tokenizers whose tokenizer.json sits beside
them: AutoTokenizer on that tokenizer.json gives the ids (with the special tokens it adds) and
the decoded text the tokenizer we build from the GGUF metadata must give
(crates/cli/src/text/gguf_tokenizer.rs).

The models (each a variant a real vocabulary has):
- llama:   Llama 2's settings (identity normalization, the dummy prefix, whitespace kept, byte
           fallback, digits split, user-defined pieces `<sep>` and `[TOOL]`, listed in
           tokenizer_config.json as the hub's repositories list them), and Llama's whitespace pieces
           ("▁▁", "▁▁▁▁", ...: normal pieces at low ids with a score of -1e9, spliced into the
           model after training as Meta's tokenizer.model has them), so that ranking merges
           by id instead of by score gives other tokens;
- nodummy: no dummy prefix (tokenizer_config.json says `add_prefix_space: false`, which is how
           llama.cpp's converter learns it);
- nobytes: no byte fallback: characters outside the vocabulary become <unk>;
- squeeze: `remove_extra_whitespaces` (the converter does not write it for Llama-style
           vocabularies; this script adds `tokenizer.ggml.remove_extra_whitespaces` to the
           converted file, as a file that says so would carry it).

Usage (the reference environment of shared/REFERENCE.md, plus sentencepiece and protobuf):
    LLAMA_CPP=/path/to/llama_cpp_python-0.3.36/vendor/llama.cpp \
        /tmp/ref/bin/python scripts/sentencepiece_fixtures.py
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/cli/tests/fixtures/tokenizers"
LLAMA_CPP = Path(os.environ["LLAMA_CPP"])
sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
import gguf  # noqa: E402  (llama.cpp's own, vendored beside the converter)

USER_DEFINED = ["<sep>", "[TOOL]"]

# Words of many scripts; the corpus and the training text draw from them with different seeds.
POOLS = {
    "latin": "the quick brown fox jumps over lazy dog Hello World hello world tokenizer "
    "sentence piece model Llama Mistral café naïve résumé Straße Äpfel über façade "
    "déjà vu São Paulo Zürich smörgåsbord ¿Qué tal? ¡Hola! Ångström".split(),
    "cyrillic": "Привет мир нещо на Български язык русский Москва съешь ещё этих мягких".split(),
    "greek": "Καλημέρα κόσμε ελληνικά γλώσσα Αθήνα".split(),
    "arabic": "مرحبا بالعالم اللغة العربية كتاب".split(),
    "hebrew": "שלום עולם עברית ספר".split(),
    "devanagari": "नमस्ते दुनिया हिन्दी भाषा किताब".split(),
    "thai": "สวัสดีชาวโลก ภาษาไทย หนังสือ".split(),
    "cjk": "你好世界 中文 汉字 北京 东京 日本語 ひらがな カタカナ 한국어 안녕하세요 서울".split(),
    "emoji": ["🦙", "🦙🦙", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🔥", "✨", "🧪"],
    "digits": ["0", "7", "42", "123", "2026", "3.14159", "1,000,000", "0x1F", "1e-9", "½", "٣", "७"],
    "punct": [".", ",", "!", "?", ":", ";", "...", "—", "–", "(", ")", "[", "]", "{", "}",
              "\"", "'", "«", "»", "„", "“", "”", "@", "#", "$", "%", "&", "*", "/", "\\",
              "<", ">", "=", "+", "-", "_", "|", "~", "^", "`"],
    "code": ["def", "fn", "main()", "{}", "=>", "::", "self.x", "x+=1", "if x:", "return 0;",
             "<div>", "</div>", "#include", "std::vector<int>", "print('hi')", "a[i]"],
    "odd": ["\u00a0", "\u3000", "\u2581", "\u2581\u2581", "\ufeff", "\u200b", "\u200d", "e\u0301",
            "\u0085", "\u2028", "\x00", "\x7f", "\x1b[0m", "\ufffd", "<s>", "</s>", "<unk>",
            "<0x41>", "<se", "sep>", "[TOO", "OOL]", "▁Hello"],
    "special": USER_DEFINED,
}
SEPARATORS = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "", "    ", "\t\t"]


def phrase(rng: random.Random, pools: list[str], n: int) -> str:
    words = [rng.choice(POOLS[rng.choice(pools)]) for _ in range(n)]
    out = ""
    for w in words:
        out += w + rng.choice(SEPARATORS)
    return out.rstrip(" ") if rng.random() < 0.5 else out


def training_text() -> str:
    rng = random.Random(1)
    names = [k for k in POOLS if k not in ("odd", "special")]
    lines = [phrase(rng, names, rng.randint(3, 14)).replace("\n", " ") for _ in range(6000)]
    # Runs of spaces (code indentation), so whitespace pieces are learned where allowed.
    lines += ["    " + phrase(rng, ["code", "latin"], 4) for _ in range(800)]
    lines += [" ".join(USER_DEFINED) + " " + phrase(rng, names, 3) for _ in range(50)]
    return "\n".join(lines)


def corpus() -> list[str]:
    texts: list[str] = []
    # The strings the GGUF tokenizer tests already use (Unicode, emoji, runs of whitespace).
    texts += json.loads((ROOT / "crates/block/tests/fixtures/gguf/tokenizer_corpus.json").read_text())
    # llama.cpp's own test strings for SentencePiece vocabularies.
    inp = (LLAMA_CPP / "models/ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    texts += [t for t in inp.split("\n__ggml_vocab_test__\n") if t]
    rng = random.Random(2026)
    everything = list(POOLS)
    hand = ["", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \t\n", "Hello", " Hello", "  Hello",
            "Hello ", "Hello  ", "    Hello\n    Hello", "\tHello", "\nHello", "Hello\n",
            "<s>Hello</s>", "a<sep>b", "a <sep> b", "<sep>", "<sep><sep>", " <sep>", "[TOOL]x", "x [TOOL] y",
            "▁", "▁▁Hello", "x▁y", "1234567890", "   1 2 3", "\u3000Hello\u3000", "\u00a0x"]
    texts += hand
    while len(texts) < 5400:
        kind = rng.random()
        if kind < 0.5:
            t = phrase(rng, everything, rng.randint(1, 10))
        elif kind < 0.7:
            t = rng.choice(SEPARATORS) * rng.randint(0, 3) + phrase(rng, everything, rng.randint(1, 6))
        elif kind < 0.85:
            # Whitespace runs of every length between words.
            t = (" " * rng.randint(0, 9)).join(rng.choice(POOLS["latin"]) for _ in range(rng.randint(1, 5)))
            t = " " * rng.randint(0, 6) + t + " " * rng.randint(0, 3)
        else:
            t = "".join(rng.choice(rng.choice(list(POOLS.values()))) for _ in range(rng.randint(1, 8)))
        texts.append(t)
    seen = set()
    unique = []
    for t in texts:
        if t not in seen:
            seen.add(t)
            unique.append(t)
    return unique


def splice_llama_whitespace(model_file: Path) -> None:
    """Puts Llama's whitespace pieces right after the byte pieces, as normal pieces with a
    score of -1e9 (where Llama 2's tokenizer.model has "▁▁" at id 259 and so on)."""
    m = pb.ModelProto()
    m.ParseFromString(model_file.read_bytes())
    runs = ["▁▁", "▁▁▁▁", "▁▁▁", "▁▁▁▁▁▁▁▁", "▁▁▁▁▁▁", "▁▁▁▁▁", "\t\t", "▁▁▁▁▁▁▁"]
    kept = [p for p in m.pieces if p.piece not in runs]
    last_byte = max(i for i, p in enumerate(kept) if p.type == pb.ModelProto.SentencePiece.BYTE)
    new = []
    for r in runs:
        p = pb.ModelProto.SentencePiece()
        p.piece, p.score, p.type = r, -1e9, pb.ModelProto.SentencePiece.NORMAL
        new.append(p)
    pieces = kept[: last_byte + 1] + new + kept[last_byte + 1:]
    del m.pieces[:]
    m.pieces.extend(pieces)
    model_file.write_bytes(m.SerializeToString())


MODELS = {
    "llama": dict(byte_fallback=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
                  split_digits=True, allow_whitespace_only_pieces=True, vocab_size=1800,
                  user_defined_symbols=USER_DEFINED),
    "nodummy": dict(byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
                    vocab_size=1200, user_defined_symbols=USER_DEFINED[:1]),
    "nobytes": dict(byte_fallback=False, add_dummy_prefix=True, remove_extra_whitespaces=False,
                    vocab_size=900, character_coverage=0.995),
    "squeeze": dict(byte_fallback=True, add_dummy_prefix=True, remove_extra_whitespaces=True,
                    vocab_size=1000),
}


def add_metadata(path: Path, key: str, value: bool) -> None:
    """Rewrites a vocabulary-only GGUF file with one more boolean key."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), vtype)
    writer.add_bool(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


def convert(name: str, model_file: Path, work: Path, add_prefix_space: bool) -> Path:
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    d = work / name
    d.mkdir()
    shutil.copy(model_file, d / "tokenizer.model")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": sp.get_piece_size(), "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id()}))
    # As the hub's Llama-family repositories carry it (written by transformers 4): the
    # user-defined pieces listed as added tokens that are not special, which is how the
    # converter learns their type (it does not ask the model); and `add_prefix_space`.
    # (The converter would promote a piece written like "<|...|>" to a control token.)
    config = {"added_tokens_decoder": {
        str(sp.piece_to_id(u)): {"content": u, "special": False, "normalized": False,
                                 "lstrip": False, "rstrip": False, "single_word": False}
        for u in USER_DEFINED if sp.piece_to_id(u) != sp.unk_id()}}
    if not add_prefix_space:
        config["add_prefix_space"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    out = OUT / f"spm_{name}.gguf"
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(d), "--outfile",
                    str(out), "--vocab-only"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")})
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    (OUT / "corpus.json").write_text(json.dumps(texts, ensure_ascii=False, indent=0) + "\n")
    print(f"corpus: {len(texts)} strings")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train = work / "train.txt"
        train.write_text(training_text())
        for name, options in MODELS.items():
            opts = dict(options)
            prefix = work / name
            spm.SentencePieceTrainer.train(
                input=str(train), model_prefix=str(prefix), model_type="bpe",
                normalization_rule_name="identity", character_coverage=opts.pop("character_coverage", 1.0),
                minloglevel=2, **opts)
            model_file = prefix.with_suffix(".model")
            if name == "llama":
                splice_llama_whitespace(model_file)
            gguf_path = convert(name, model_file, work, opts["add_dummy_prefix"])
            if opts["remove_extra_whitespaces"]:
                add_metadata(gguf_path, "tokenizer.ggml.remove_extra_whitespaces", True)
            sp = spm.SentencePieceProcessor(model_file=str(model_file))
            ids = [sp.encode(t) for t in texts]
            decoded = {}
            for i, (t, e) in enumerate(zip(texts, ids)):
                d = sp.decode(e)
                if d != t:
                    decoded[str(i)] = d
            rng = random.Random(7)
            n = sp.get_piece_size()
            random_ids = [[rng.randrange(n) for _ in range(rng.randint(1, 12))] for _ in range(500)]
            # Byte pieces alone and in runs: valid, cut and invalid UTF-8.
            byte_ids = [i for i in range(n) if sp.is_byte(i)]
            if byte_ids:
                random_ids += [[rng.choice(byte_ids) for _ in range(rng.randint(1, 6))] for _ in range(200)]
            expected = {
                "model": name,
                "options": {k: v for k, v in MODELS[name].items()},
                "pieces": n,
                "ids": [" ".join(map(str, e)) for e in ids],
                "decoded_where_different": decoded,
                "random_ids": random_ids,
                "random_decoded": [sp.decode(r) for r in random_ids],
            }
            (OUT / f"spm_{name}.json").write_text(json.dumps(expected, ensure_ascii=False) + "\n")
            print(f"{name}: {n} pieces, {sum(len(e) for e in ids)} ids, "
                  f"{len(decoded)} strings decode differently, {gguf_path.stat().st_size} bytes of GGUF")


def byte_level(texts: list[str]) -> None:
    from transformers import PreTrainedTokenizerFast
    for name in ["gpt2", "qwen2"]:
        path = ROOT / f"crates/block/tests/fixtures/gguf/{name}.tokenizer.json"
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        ids = [tok(t)["input_ids"] for t in texts]
        decoded = {str(i): tok.decode(e) for i, (t, e) in enumerate(zip(texts, ids)) if tok.decode(e) != t}
        expected = {"tokenizer": f"crates/block/tests/fixtures/gguf/{name}.tokenizer.json",
                    "ids": [" ".join(map(str, e)) for e in ids], "decoded_where_different": decoded}
        (OUT / f"bytelevel_{name}.json").write_text(json.dumps(expected, ensure_ascii=False) + "\n")
        print(f"{name}: {sum(len(e) for e in ids)} ids, {len(decoded)} strings decode differently")


if __name__ == "__main__":
    main()
    byte_level(json.loads((OUT / "corpus.json").read_text()))
