"""Real chat templates rendered by transformers, for the differential test of our renderer.

Every template of llama.cpp's models/templates/ (real models' templates, as their hub
repositories publish them), the five our earlier tests used (Llama 3.2, Qwen2.5 and SmolLM3
from the same directory; Zephyr/TinyLlama and SmolLM2 as their tokenizer_config.json on the hub
publishes them) and Gemma 3's (from transformers' own Gemma 3 converter), each rendered by
transformers' own `apply_chat_template` (Python Jinja2 in its
sandbox, with transformers' `tojson`, `raise_exception`, `strftime_now`, the `generation` tag,
`namespace` and `dict`, and the special tokens as variables) for ten conversations, with
`add_generation_prompt` both ways. What transformers raises is recorded as a refusal: our
renderer must then refuse too.

The clock is fixed (2024-07-26 12:00 UTC) so that `strftime_now` renders the same every day.

Writes crates/cli/tests/fixtures/chat/: templates/NAME.jinja, SOURCES.md (where each came from),
conversations.json, expected.json ([{template, conversation, add_generation_prompt, text} or
{..., error}]).

Usage:
    LLAMA_CPP=/path/to/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        /tmp/ref/bin/python scripts/chat_template_fixtures.py
"""

import datetime as real_datetime
import json
import os
from pathlib import Path

import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/cli/tests/fixtures/chat"
LLAMA_CPP = Path(os.environ["LLAMA_CPP"])

# Published in their hub repositories' tokenizer_config.json (not in llama.cpp's directory).
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
          "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
          "{% endfor %}")
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
           "%}{{ '<|im_start|>assistant\n' }}{% endif %}")

# The template transformers' Gemma 3 converter writes beside the tokenizer (its `_CHAT_TEMPLATE`,
# huggingface/transformers src/transformers/models/gemma3/convert_gemma3_weights_orbax_to_hf.py at
# 58827fc), as Gemma 3's instruction-tuned hub repositories publish it; llama.cpp's directory has
# Gemma 2's and Gemma 4's only. Copied as the Python source spells it ("\n" inside its Jinja strings
# is a newline).
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# The special tokens' texts of the models whose tokens the templates name; others get Llama's.
SPECIAL = {
    "meta-llama": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen": ("<|endoftext|>", "<|im_end|>"),
    "HuggingFaceTB": ("<|im_start|>", "<|im_end|>"),
    "google": ("<bos>", "<eos>"),
    "mistralai": ("<s>", "</s>"),
    "microsoft": ("<s>", "<|endoftext|>"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Searches the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}}}

# (messages, tools, documents, extra variables)
CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}], None, None, {}),
    ([{"role": "system", "content": "You are a terse assistant."},
      {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "4."},
      {"role": "user", "content": "And 3+3?"}], None, None, {}),
    ([{"role": "system", "content": "Réponds en français, s'il te plaît. 🙂"},
      {"role": "user", "content": "Où est la gare ?  Ça va\nbien ?"},
      {"role": "assistant", "content": "  La gare est à gauche.  "},
      {"role": "user", "content": "日本語でも？ Привет — ﬁne\t\"quoted\" 'single'"}], None, None, {}),
    # A tool call whose arguments are a mapping (transformers' convention), its result, the answer.
    ([{"role": "system", "content": "You can call tools."},
      {"role": "user", "content": "What's the weather in Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
      {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temperature\": 21}"},
      {"role": "assistant", "content": "It is 21 °C in Paris."}], [WEATHER, SEARCH], None, {}),
    # Two calls at once with arguments as JSON text (OpenAI's wire format), then their results.
    ([{"role": "user", "content": "Weather in Oslo, and news about it?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "call_a", "type": "function",
           "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
          {"id": "call_b", "type": "function",
           "function": {"name": "search", "arguments": "{\"query\": \"Oslo news\", \"limit\": 3}"}}]},
      {"role": "tool", "tool_call_id": "call_a", "content": "-3 degrees"},
      {"role": "tool", "tool_call_id": "call_b", "content": "Nothing new."}], [WEATHER, SEARCH], None, {}),
    # An assistant turn last (a prefilled reply).
    ([{"role": "user", "content": "Write a haiku."},
      {"role": "assistant", "content": "Autumn moonlight—"}], None, None, {}),
    # Reasoning kept with the reply, thinking switched on.
    ([{"role": "user", "content": "Is 91 prime?"},
      {"role": "assistant", "reasoning_content": "91 = 7 × 13.", "content": "No: 7 × 13."},
      {"role": "user", "content": "And 97?"}], None, None, {"enable_thinking": True}),
    # Thinking switched off.
    ([{"role": "system", "content": ""},
      {"role": "user", "content": "Say yes."}], None, None, {"enable_thinking": False}),
    # Documents for retrieval-augmented templates.
    ([{"role": "user", "content": "Summarise the documents."}], None,
     [{"title": "Tea", "text": "Tea is a drink."}, {"title": "Coffee", "text": "Coffee is too."}], {}),
    # Content as a list of text parts.
    ([{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]}],
     None, None, {}),
]


class FixedDatetime(real_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2024, 7, 26, 12, 0, 0, tzinfo=tz)


def templates() -> dict[str, tuple[str, str]]:
    """name -> (template, where it came from)."""
    out = {}
    real = LLAMA_CPP / "models" / "templates"
    for path in sorted(real.glob("*.jinja")):
        out[path.stem] = (path.read_text(encoding="utf-8"),
                          f"llama.cpp models/templates/{path.name} (llama-cpp-python 0.3.36's vendored tree)")
    out["zephyr"] = (ZEPHYR, "HuggingFaceH4/zephyr-7b-beta tokenizer_config.json (TinyLlama-1.1B-Chat's too)")
    out["smollm2"] = (SMOLLM2, "HuggingFaceTB/SmolLM2-135M-Instruct tokenizer_config.json")
    out["google-gemma-3-it"] = (GEMMA3, "transformers' Gemma 3 converter, `_CHAT_TEMPLATE` in "
                                "src/transformers/models/gemma3/convert_gemma3_weights_orbax_to_hf.py "
                                "(huggingface/transformers 58827fc)")
    return out


def special(name: str) -> tuple[str, str]:
    for prefix, tokens in SPECIAL.items():
        if name.startswith(prefix):
            return tokens
    return ("<s>", "</s>")


def main() -> None:
    # transformers' strftime_now reads `datetime.now()` from this module.
    chat_template_utils.datetime = FixedDatetime
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "templates").mkdir(exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    all_templates = templates()
    expected = []
    sources = ["# Where the chat templates come from", "",
               "Rendered by transformers " + transformers.__version__ +
               " for the differential test (scripts/chat_template_fixtures.py).", "",
               "| template | source |", "|---|---|"]
    for name, (template, source) in all_templates.items():
        (OUT / "templates" / f"{name}.jinja").write_text(template, encoding="utf-8")
        sources.append(f"| {name} | {source} |")
        bos, eos = special(name)
        tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token = bos, eos, "<unk>", "<pad>"
        for i, (messages, tools, documents, extra) in enumerate(CONVERSATIONS):
            for agp in (True, False):
                case = {"template": name, "conversation": i, "add_generation_prompt": agp,
                        "bos_token": bos, "eos_token": eos}
                try:
                    case["text"] = tok.apply_chat_template(
                        messages, tools=tools, documents=documents, chat_template=template,
                        tokenize=False, add_generation_prompt=agp, **extra)
                except Exception as e:  # noqa: BLE001 (every refusal is recorded as one)
                    case["error"] = f"{type(e).__name__}: {e}"
                expected.append(case)
    conversations = [{"messages": m, "tools": t, "documents": d, "extra": x}
                     for m, t, d, x in CONVERSATIONS]
    (OUT / "conversations.json").write_text(json.dumps(conversations, ensure_ascii=False, indent=1) + "\n")
    (OUT / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=0) + "\n")
    (OUT / "SOURCES.md").write_text("\n".join(sources) + "\n")
    refused = sum("error" in c for c in expected)
    print(f"{len(all_templates)} templates, {len(CONVERSATIONS)} conversations, {len(expected)} renderings, "
          f"{refused} refused by transformers")


if __name__ == "__main__":
    main()
