"""The official `anthropic` package against `ferrolm serve`'s Messages API (started by
tests/serve.rs).

Usage: anthropic_client.py BASE_URL   (the server's key is "test-key")
"""
import sys

import anthropic

# This SDK's methods take no sampling parameters: they go in `extra_body`.
client = anthropic.Anthropic(base_url=sys.argv[1], api_key="test-key", timeout=60, max_retries=0)

ask = [{"role": "user", "content": "What is the capital of France?"}]
message = client.messages.create(
    model="smollm2", max_tokens=16, extra_body={"temperature": 0}, system="Be brief.", messages=ask
)
assert message.role == "assistant" and message.type == "message", message
assert message.content[0].type == "text" and message.content[0].text, message
assert message.stop_reason in ("end_turn", "max_tokens"), message
assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0, message

# Streamed: the same text, through the client's event stream helper.
with client.messages.stream(
    model="smollm2", max_tokens=16, extra_body={"temperature": 0}, system="Be brief.", messages=ask
) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text == message.content[0].text, (text, message.content[0].text)
assert final.stop_reason == message.stop_reason, final

# Tool use: a required call whose input validates against the tool's schema.
tools = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    }
]
weather = [{"role": "user", "content": "What is the weather in Paris?"}]
used = client.messages.create(
    model="smollm2",
    max_tokens=80,
    extra_body={"temperature": 1.0},
    messages=weather,
    tools=tools,
    tool_choice={"type": "tool", "name": "get_weather"},
)
assert used.stop_reason == "tool_use", used
call = [b for b in used.content if b.type == "tool_use"][0]
assert call.name == "get_weather" and call.input["unit"] in ("celsius", "fahrenheit"), call
with client.messages.stream(
    model="smollm2",
    max_tokens=80,
    extra_body={"temperature": 0.5},
    messages=weather,
    tools=tools,
    tool_choice={"type": "any"},
) as stream:
    streamed = stream.get_final_message()
assert streamed.stop_reason == "tool_use", streamed
assert [b for b in streamed.content if b.type == "tool_use"][0].input["city"], streamed
# The result goes back in.
after = client.messages.create(
    model="smollm2",
    max_tokens=16,
    extra_body={"temperature": 0},
    messages=weather
    + [
        {"role": "assistant", "content": [b.model_dump() for b in used.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}],
        },
    ],
    tools=tools,
)
assert after.stop_reason in ("end_turn", "max_tokens", "tool_use"), after

try:
    anthropic.Anthropic(base_url=sys.argv[1], api_key="wrong", max_retries=0).messages.create(
        model="smollm2", max_tokens=4, messages=ask
    )
    raise AssertionError("a wrong key was accepted")
except anthropic.AuthenticationError as e:
    assert e.status_code == 401

print("anthropic client: ok")
