"""The official `openai` package against `ferrolm serve` (started by tests/serve.rs).

Usage: openai_client.py BASE_URL   (the server's key is "test-key")
"""
import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="test-key", timeout=60, max_retries=0)

models = client.models.list()
ids = [m.id for m in models.data]
assert ids == ["smollm2"], ids

messages = [{"role": "user", "content": "What is the capital of France?"}]
chat = client.chat.completions.create(
    model="smollm2", messages=messages, max_tokens=16, temperature=0
)
text = chat.choices[0].message.content
assert chat.choices[0].message.role == "assistant"
assert isinstance(text, str) and text, text
assert chat.choices[0].finish_reason in ("stop", "length")
assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0

stream = client.chat.completions.create(
    model="smollm2",
    messages=messages,
    max_tokens=16,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == text, ("".join(pieces), text)
assert finish == chat.choices[0].finish_reason
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

done = client.completions.create(
    model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0
)
assert done.choices[0].text.startswith(" Paris"), done.choices[0].text
assert done.choices[0].finish_reason == "length"
assert done.usage.completion_tokens == 6

streamed = client.completions.create(
    model="smollm2",
    prompt="The capital of France is",
    max_tokens=6,
    temperature=0,
    stream=True,
)
assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text

try:
    client.chat.completions.create(model="gpt-17", messages=messages, max_tokens=2)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404

try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401

print("openai client: ok")
