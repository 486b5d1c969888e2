"""How many words of sampled continuations are words of the training text.

    python3 scripts/real_words.py --corpus /tmp/shakespeare.txt [--model DIR] [--gpt PATH]
        [--prompt "ROMEO:" ...] [--seeds 20] [--tokens 64] [--temperature 0.8] [--show]

For each prompt and each seed 1..--seeds, `gpt generate --max-new-tokens 64 --temperature
0.8 --seed N` (the built-in model without --model) continues the prompt; the words of the
continuation (the prompt itself excluded) are looked up, ignoring case, among the words of
the training text: the corpus without its last 10% (`gpt train` holds out the last 10% of
the tokens for validation). A word is a run of ASCII letters, with apostrophes inside
("o'er", "ne'er"); the same rule splits the corpus. The last word of a continuation is
dropped when the text ends inside it (the token limit can cut a word in two). Prints the
count, the share, and with --show the words not found. Standard library only.
"""
import argparse
import os
import re
import subprocess
import sys

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--model")
    p.add_argument("--gpt", default=os.path.join(ROOT, "target", "release", "gpt"))
    p.add_argument("--prompt", action="append")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--show", action="store_true")
    a = p.parse_args()
    prompts = a.prompt or ["ROMEO:"]
    text = open(a.corpus, encoding="utf-8").read()
    known = {w.lower() for w in WORD.findall(text[: len(text) * 9 // 10])}
    total, found, unknown = 0, 0, []
    for prompt in prompts:
        for seed in range(1, a.seeds + 1):
            cmd = [a.gpt, "generate", "--prompt", prompt, "--max-new-tokens", str(a.tokens),
                   "--temperature", str(a.temperature), "--seed", str(seed)]
            if a.model:
                cmd += ["--model", a.model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0 or not out.stdout.startswith(prompt):
                sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
            new = out.stdout[len(prompt):].rstrip("\n")
            words = WORD.findall(new)
            if words and new[-1:].isalpha():
                words.pop()
            for w in words:
                total += 1
                if w.lower() in known:
                    found += 1
                else:
                    unknown.append(w)
    share = 100.0 * found / max(total, 1)
    print(f"{found} of {total} words ({share:.1f}%) occur in the training text "
          f"({len(prompts)} prompt(s) x {a.seeds} seeds, {a.tokens} new tokens, "
          f"temperature {a.temperature})")
    if a.show:
        print("not found:", ", ".join(unknown))


if __name__ == "__main__":
    main()
