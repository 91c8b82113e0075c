"""langchain-openai (a client this project did not write) against a real `kvserve serve`: invoke,
stream with usage, batch (issue 32). Each answer must be what the server gives the official client
for the same greedy request, so a field langchain sends that the server dropped or misread shows."""

from __future__ import annotations

import pytest

langchain_openai = pytest.importorskip("langchain_openai")

from tests.serving import MODEL  # noqa: E402

QUESTION = "Name three colors."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def chat(tiny_server):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=tiny_server.v1, api_key="unused", temperature=0,
                                       max_tokens=MAX_TOKENS, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(client) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens) of the same request through the official client."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_tokens=MAX_TOKENS)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens


def test_invoke(chat, expected) -> None:
    msg = chat.invoke(QUESTION)
    assert msg.content == expected[0]
    assert msg.usage_metadata["input_tokens"] == expected[1]
    assert msg.usage_metadata["output_tokens"] == expected[2]


def test_stream_with_usage(tiny_server, expected) -> None:
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=tiny_server.v1, api_key="unused", temperature=0,
                                       max_tokens=MAX_TOKENS, max_retries=0, timeout=60, stream_usage=True)
    chunks = list(chat.stream(QUESTION))
    assert len(chunks) > 2
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.content == expected[0]
    assert (total.usage_metadata["input_tokens"], total.usage_metadata["output_tokens"]) == expected[1:]


def test_batch(chat, expected, client) -> None:
    other = "Count to five."
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": other}],
                                       temperature=0, max_tokens=MAX_TOKENS)
    out = chat.batch([QUESTION, other])
    assert [m.content for m in out] == [expected[0], r.choices[0].message.content]
