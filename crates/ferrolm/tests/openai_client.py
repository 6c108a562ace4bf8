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

# Structured outputs: the client's own calls, at temperature 1, streamed and not.
import json

import pydantic


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    # Bounded: an unbounded integer may take all of max_tokens at temperature 1.
    population: int = pydantic.Field(ge=0, le=100_000_000)


schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
city_messages = [{"role": "user", "content": "Describe Paris as JSON."}]
for seed in range(3):
    out = client.chat.completions.create(
        model="smollm2",
        messages=city_messages,
        max_tokens=120,
        temperature=1.0,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    city = City.model_validate_json(out.choices[0].message.content)
    assert out.choices[0].finish_reason == "stop", out
streamed = client.chat.completions.create(
    model="smollm2",
    messages=city_messages,
    max_tokens=120,
    temperature=1.0,
    seed=5,
    stream=True,
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
)
City.model_validate_json("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
parsed = client.chat.completions.parse(
    model="smollm2", messages=city_messages, max_tokens=120, temperature=0.7, response_format=City
)
assert isinstance(parsed.choices[0].message.parsed, City), parsed
anything = client.chat.completions.create(
    model="smollm2",
    messages=city_messages,
    max_tokens=120,
    temperature=1.0,
    seed=3,
    response_format={"type": "json_object"},
)
# Free-form JSON may run past max_tokens (inside a string, say); what ends by itself parses.
assert anything.choices[0].message.content.startswith("{"), anything
if anything.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(anything.choices[0].message.content), dict), anything
try:
    client.chat.completions.create(
        model="smollm2",
        messages=city_messages,
        max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    )
    raise AssertionError("a schema that cannot compile was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "nope" in str(e), e

# Tool calls: required and named calls are constrained to the tool's parameters.
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 20}},
                "required": ["zone"],
            },
        },
    },
]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
    out = client.chat.completions.create(
        model="smollm2",
        messages=ask,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=1.0,
    )
    choice0 = out.choices[0]
    assert choice0.finish_reason == "tool_calls", out
    assert len(choice0.message.tool_calls) == 1, out
    call = choice0.message.tool_calls[0]
    assert call.type == "function" and call.id, call
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit"), args
    else:
        assert choice == "required" and call.function.name == "get_time", call
        assert isinstance(args["zone"], str), args
stream = client.chat.completions.create(
    model="smollm2",
    messages=ask,
    tools=tools,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    max_tokens=80,
    temperature=0.5,
    stream=True,
)
names, arguments, finish = {}, {}, None
for chunk in stream:
    for c in chunk.choices:
        for d in c.delta.tool_calls or []:
            if d.function.name:
                names[d.index] = d.function.name
            arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
        finish = c.finish_reason or finish
assert finish == "tool_calls" and names[0] == "get_weather", (names, finish)
assert json.loads(arguments[0])["unit"] in ("celsius", "fahrenheit"), arguments
# The call and its result go back in; the model answers (it may call again or not).
answered = client.chat.completions.create(
    model="smollm2",
    messages=ask
    + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ],
    tools=tools,
    max_tokens=24,
    temperature=0,
)
assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls"), answered

print("openai client: ok")
