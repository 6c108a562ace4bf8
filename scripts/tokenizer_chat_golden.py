#!/usr/bin/env python3
"""Golden chat-template renderings from Python's jinja2, set up as Hugging Face transformers does
(trim_blocks, lstrip_blocks, raise_exception, strftime_now, tojson like json.dumps).

Templates: SmolLM2's (read from the GGUF), Gemma 3's (tests/golden/gemma3_chat_template.jinja,
the template of google/gemma-3-*-it; the Gemma 3 270M GGUF carries none), Gemma 2's (from
llama.cpp's models/templates, also in tests/golden), and ferrolm's ChatML fallback.
Writes crates/ferrolm-tokenizer/tests/golden/chat_templates.json.
Usage: python3 scripts/tokenizer_chat_golden.py [FERROLM_HOME]
"""
import json
import os
import sys
from datetime import datetime

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GOLDEN = os.path.join(ROOT, "crates", "ferrolm-tokenizer", "tests", "golden")
HOME = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))

CHATML = ("{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\\n' -}}\n{%- endif -%}")


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(src, messages, add_generation_prompt, bos, eos, tools=None):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return {"text": env.from_string(src).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    bos_token=bos, eos_token=eos, tools=tools)}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def gguf_template(path):
    r = gguf.GGUFReader(path)
    f = r.fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Goodbye."}],
    # assistant prefill: the last message is the start of the answer
    [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight"}],
    [{"role": "user", "content": "  padded with spaces and\nnewlines  \n"}],
    [{"role": "user", "content": "Unicode: café 你好 😀 «ok» <b>tags</b> {{ not a tag }} {% raw %}"}],
    [{"role": "user", "content": "!shout this\tplease now   "}],
    [{"role": "system", "content": "  sys  "}, {"role": "user", "content": "one two three four five"}],
    [{"role": "user", "content": ""}],
    # roles out of order: Gemma's template raises
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Odd."}],
    [{"role": "system", "content": "Multi\nline\nsystem."}, {"role": "user", "content": "Go"}],
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C <now>",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"a": 1, "b": 2.5, "c": None, "d": True}}},
]


def main():
    smol = gguf_template(os.path.join(HOME, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    with open(os.path.join(GOLDEN, "gemma3_chat_template.jinja"), encoding="utf-8") as f:
        gemma3 = f.read()
    with open(os.path.join(GOLDEN, "gemma2_chat_template.jinja"), encoding="utf-8") as f:
        gemma2 = f.read()
    with open(os.path.join(GOLDEN, "pycompat_chat_template.jinja"), encoding="utf-8") as f:
        pycompat = f.read()
    templates = {
        "smollm2": {"source": smol, "bos": "<|im_start|>", "eos": "<|im_end|>"},
        "gemma3": {"source": gemma3, "bos": "<bos>", "eos": "<eos>"},
        "gemma2": {"source": gemma2, "bos": "<bos>", "eos": "<eos>"},
        "chatml": {"source": CHATML, "bos": "", "eos": ""},
        "pycompat": {"source": pycompat, "bos": "", "eos": ""},
    }
    cases = []
    for name, t in templates.items():
        for ci, conv in enumerate(CONVERSATIONS):
            for agp in (True, False):
                out = render(t["source"], conv, agp, t["bos"], t["eos"])
                cases.append({"template": name, "conversation": ci, "add_generation_prompt": agp, **out})
    for name in ("pycompat", "chatml", "smollm2"):
        t = templates[name]
        for ci in (1, 2):
            out = render(t["source"], CONVERSATIONS[ci], True, t["bos"], t["eos"], tools=TOOLS)
            cases.append({"template": name, "conversation": ci, "add_generation_prompt": True, "tools": True, **out})
    doc = {"tools": TOOLS, "generator": "scripts/tokenizer_chat_golden.py, jinja2 " + jinja2.__version__,
           "templates": templates, "conversations": CONVERSATIONS, "cases": cases}
    with open(os.path.join(GOLDEN, "chat_templates.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(len(cases), "renderings,", sum("error" in c for c in cases), "errors")


if __name__ == "__main__":
    main()
