"""/v1/completions with echo: prompt text and prompt logprobs before the completion."""

from __future__ import annotations

import pytest
import torch

from tests.serving import MODEL, PROMPT

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_factory, tokenizer):
    """log p(prompt[j] | prompt[:j]) from HF transformers on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_factory("llama")), torch_dtype=torch.float32)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return ids, [lps[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_echo_text_and_stream(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    assert echoed.usage.completion_tokens == 6 or echoed.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain


def test_echo_token_ids_decodes_prompt(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(tokenizer.decode(ids))


def test_echo_logprobs_match_hf(client, hf_prompt_logprobs):
    ids, ref = hf_prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = lp.token_logprobs[1:len(ids)]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])  # top-2 plus the actual token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_max_tokens_zero_scores_prompt(client, hf_prompt_logprobs):
    ids, ref = hf_prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == PROMPT
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref)) < 1e-3
    with pytest.raises(openai.BadRequestError) as e:  # without echo, 0 tokens is a mistake
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in e.value.message
