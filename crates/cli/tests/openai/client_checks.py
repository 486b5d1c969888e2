"""Drives `gpt serve` with the official `openai` Python client, as users will.

Run by crates/cli/tests/serve.rs (which starts the server and installs the pinned client
from requirements.txt into a virtual environment under the target directory):

    python client_checks.py BASE_URL EXPECTED_JSON

EXPECTED_JSON holds what `gpt generate` printed for the same prompts (greedy and
seeded). Every check raises on failure; the process exits 0 only when all pass.
"""

import concurrent.futures
import json
import sys

import jsonschema
import openai

base_url, expected_path = sys.argv[1], sys.argv[2]
with open(expected_path, encoding="utf-8") as f:
    expected = json.load(f)
prompt = expected["prompt"]
client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
model = client.models.list().data[0].id
checks = []


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    checks.append(name)


# Completions, greedy: the text `gpt generate --temperature 0` prints after the prompt.
c = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
check("completion equals gpt generate", c.choices[0].text == expected["greedy"],
      f"{c.choices[0].text!r} != {expected['greedy']!r}")
check("completion usage", c.usage.completion_tokens == 24 and c.usage.prompt_tokens > 0
      and c.usage.total_tokens == c.usage.prompt_tokens + 24, c.usage)
check("finish at length", c.choices[0].finish_reason == "length", c.choices[0].finish_reason)

# Sampled with a seed: the same as `gpt generate --seed 5 --temperature 0.8`, every time.
runs = [client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                  temperature=0.8, seed=5).choices[0].text for _ in range(2)]
check("seed reproducible", runs[0] == runs[1], runs)
check("seeded completion equals gpt generate", runs[0] == expected["seeded"],
      f"{runs[0]!r} != {expected['seeded']!r}")
other = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                  temperature=0.8, seed=6).choices[0].text
check("another seed, another text", other != runs[0], other)

# Streaming gives the same text in pieces, then usage.
pieces, finish, usage = [], None, None
for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
    for ch in chunk.choices:
        pieces.append(ch.text)
        finish = ch.finish_reason or finish
    usage = chunk.usage or usage
check("streamed completion", "".join(pieces) == expected["greedy"], pieces)
check("streamed pieces", len([p for p in pieces if p]) > 1, pieces)
check("streamed finish and usage", finish == "length" and usage.completion_tokens == 24,
      (finish, usage))

# A stop string ends the text before it.
greedy = expected["greedy"]
stop = greedy[len(greedy) // 2: len(greedy) // 2 + 3]
c = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                              stop=[stop, "never-seen"])
check("stop string", c.choices[0].text == greedy[: greedy.index(stop)]
      and c.choices[0].finish_reason == "stop", (stop, c.choices[0]))

# Several prompts in one request: one choice each, each as if alone.
c = client.completions.create(model=model, prompt=[prompt, prompt + " and"], max_tokens=8,
                              temperature=0)
check("prompt list", [ch.index for ch in c.choices] == [0, 1], c.choices)
for i, p in enumerate([prompt, prompt + " and"]):
    alone = client.completions.create(model=model, prompt=p, max_tokens=8,
                                      temperature=0).choices[0].text
    check(f"prompt list row {i} as alone", c.choices[i].text == alone, (c.choices[i].text, alone))

# Log-probabilities: the greedy token is the most likely one.
c = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                              logprobs=3)
lp = c.choices[0].logprobs
check("logprobs", len(lp.tokens) == 6 and len(lp.top_logprobs) == 6
      and all(len(t) == 3 for t in lp.top_logprobs)
      and all(v <= 0 for v in lp.token_logprobs)
      and all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs)),
      lp)
check("logprob tokens spell the text", "".join(lp.tokens) == c.choices[0].text, lp.tokens)

# Chat, through the model's template (the plain User:/Assistant: format here).
messages = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": prompt}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                   temperature=0)
check("chat equals gpt generate --chat", r.choices[0].message.content == expected["chat"],
      f"{r.choices[0].message.content!r} != {expected['chat']!r}")
check("chat message", r.choices[0].message.role == "assistant"
      and r.choices[0].finish_reason in ("stop", "length") and r.usage.total_tokens > 0, r)
pieces, roles = [], []
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            temperature=0, stream=True):
    for ch in chunk.choices:
        roles.append(ch.delta.role)
        pieces.append(ch.delta.content or "")
check("streamed chat", "".join(pieces) == r.choices[0].message.content
      and roles[0] == "assistant", (pieces, roles))
r = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                   temperature=0, logprobs=True, top_logprobs=2)
content = r.choices[0].logprobs.content
check("chat logprobs", len(content) >= 1 and all(len(t.top_logprobs) == 2 for t in content),
      content)

# Structured output: a nested schema (enums, an array of bounded length, required fields,
# integers with bounds) on sampled replies: every one of 100 parses and validates. The
# requests go out 10 at a time, so they run in shared batches. (A JSON `number` may have
# any number of digits after its point, and a random model writes `1.000000...` until
# max_tokens: integers keep every reply finite.)
SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"enum": ["ROMEO", "JULIET", "NURSE"]},
        "mood": {"type": "string", "maxLength": 12},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"act": {"type": "integer", "minimum": 1,
                                                   "maximum": 5},
                                           "weight": {"type": "integer", "minimum": -40,
                                                      "maximum": 250}},
                            "required": ["act", "weight"], "additionalProperties": False}},
        "aside": {"type": "boolean"},
    },
    "required": ["speaker", "lines", "aside"],
    "additionalProperties": False,
}


def structured(seed):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Who speaks? Answer in JSON."}],
        max_tokens=200, temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "line", "schema": SCHEMA, "strict": True}})
    return r.choices[0]


with concurrent.futures.ThreadPoolExecutor(10) as pool:
    replies = list(pool.map(structured, range(100)))
valid = 0
for choice in replies:
    reply = json.loads(choice.message.content)
    jsonschema.validate(reply, SCHEMA)
    valid += choice.finish_reason == "stop"
check("100 of 100 sampled replies validate against the schema", valid == 100, valid)
# Any object: keys and strings are free, so a reply may run to max_tokens; one that ends
# before it is a whole object.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=60, seed=1,
                                   response_format={"type": "json_object"})
text, finish = r.choices[0].message.content, r.choices[0].finish_reason
check("json_object", text.startswith("{") and (
    finish == "length" or isinstance(json.loads(text), dict)), r)
try:
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "not": {"const": "a"}}}})
except openai.BadRequestError as e:
    check("an unsupported schema feature is a 400 naming it", "not" in e.body["message"], e.body)
else:
    raise AssertionError("a schema with `not`: no error")

# Mistakes are errors the client understands.
for name, call, error in [
    ("n > 1", lambda: client.completions.create(model=model, prompt=prompt, n=2),
     openai.BadRequestError),
    ("unknown model", lambda: client.completions.create(model="no-such-model", prompt=prompt),
     openai.NotFoundError),
    ("negative temperature",
     lambda: client.completions.create(model=model, prompt=prompt, temperature=-1),
     openai.BadRequestError),
    ("past the context",
     lambda: client.completions.create(model=model, prompt=prompt, max_tokens=100000),
     openai.BadRequestError),
]:
    try:
        call()
    except error as e:
        check(name, isinstance(e.body, dict) and e.body.get("message"), e.body)
    else:
        raise AssertionError(f"{name}: no error")

print(f"{len(checks)} checks passed with openai {openai.__version__}: " + "; ".join(checks))
