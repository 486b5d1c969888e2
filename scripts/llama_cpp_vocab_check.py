"""`gpt tokenize` on llama.cpp's own vocabulary test files, against references we did not write.

llama.cpp's tree carries vocabulary-only GGUF files of real models (models/ggml-vocab-*.gguf:
Llama 2's SentencePiece vocabulary, Phi-3's, GPT-2's, Llama 3's, Qwen2's, StarCoder's, ...)
with test strings (.inp) and the ids transformers' AutoTokenizer gives for them from the
model's own hub tokenizer (.out, written by convert_hf_to_gguf_update.py). For each file:
- every .inp string through `gpt tokenize --no-special` must give the .out ids;
- for SentencePiece vocabularies, SentencePiece itself (a model rebuilt from the file's
  pieces, scores and types: BPE, identity normalization, the file's flags) must give the
  same ids as `gpt tokenize --no-special --no-parse-special` on the 5,057 strings of
  crates/cli/tests/fixtures/tokenizers/corpus.json.
The files are Meta's, Microsoft's, ... vocabularies, so they are read from llama.cpp's tree
and not committed here.

Usage:
    LLAMA_CPP=/path/to/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        /tmp/ref/bin/python scripts/llama_cpp_vocab_check.py [target/release/gpt]
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path(os.environ["LLAMA_CPP"])
GPT = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target/release/gpt")
sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
import gguf  # noqa: E402


def gpt_ids(model: Path, text: str, *flags: str) -> list[int] | str:
    out = subprocess.run([GPT, "--model", str(model), "tokenize", "--format", "json", "--no-special",
                          *flags, "--file", "-"], input=text.encode(), capture_output=True)
    if out.returncode != 0:
        return out.stderr.decode().strip()
    return json.loads(out.stdout)["ids"]


def sentencepiece_of(path: Path):
    """SentencePiece with the file's pieces, scores and types."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    f = gguf.GGUFReader(str(path)).fields
    get = lambda k, d: f[k].contents() if k in f else d  # noqa: E731
    m = pb.ModelProto()
    types = list(f["tokenizer.ggml.token_type"].contents())
    # SentencePiece has one unknown piece: the one the file names (Phi-3's files, from an
    # older converter, type `<unk>` as a control token and their padding as unknown; the
    # padding, never made from text either way, becomes control here).
    if "tokenizer.ggml.unknown_token_id" in f:
        unk = int(f["tokenizer.ggml.unknown_token_id"].contents())
        types = [3 if t == 2 else t for t in types]
        types[unk] = 2
    for t, s, ty in zip(f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.scores"].contents(), types):
        p = m.pieces.add()
        p.piece, p.score, p.type = t, s, ty
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = any(t == 6 for t in types)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = bool(get("tokenizer.ggml.remove_extra_whitespaces", False))
    m.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def main() -> None:
    corpus = json.loads((ROOT / "crates/cli/tests/fixtures/tokenizers/corpus.json").read_text())
    failed = False
    for inp in sorted((LLAMA_CPP / "models").glob("ggml-vocab-*.gguf.inp")):
        model = inp.with_suffix("")
        texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
        outs = inp.with_suffix(".out").read_text(encoding="utf-8").split("\n")
        fields = gguf.GGUFReader(str(model)).fields
        kind = fields["tokenizer.ggml.model"].contents()
        pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else None
        first = gpt_ids(model, "a")
        if isinstance(first, str):
            print(f"{model.name} ({kind}, pre {pre}): refused: {first}")
            continue
        bad = []
        for text, out in zip(texts, outs):
            want = [int(x) for x in out.split()]
            got = gpt_ids(model, text)
            if got != want:
                bad.append((text, got, want))
        print(f"{model.name} ({kind}, pre {pre}): {len(texts) - len(bad)}/{len(texts)} strings as transformers")
        for text, got, want in bad[:3]:
            print(f"    {text!r}: {got} != {want}")
        failed |= bool(bad)
        if kind == "llama":
            sp = sentencepiece_of(model)
            diffs = 0
            for text in corpus:
                if gpt_ids(model, text, "--no-parse-special") != sp.encode(text):
                    diffs += 1
            print(f"    SentencePiece on {len(corpus)} corpus strings: {len(corpus) - diffs} equal")
            failed |= diffs > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
