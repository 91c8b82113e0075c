"""One `kvserve serve` process on a tiny random llama, shared by the server tests."""

from __future__ import annotations

import pytest

from tests.serving import TINY_SERVER_ARGS, Server, running_server


@pytest.fixture(scope="session")
def tiny_server(tiny_model_factory, tmp_path_factory) -> Server:
    model_dir = tiny_model_factory("llama")
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server([str(model_dir), *TINY_SERVER_ARGS], log) as srv:
        yield srv


@pytest.fixture(scope="session")
def server(tiny_server) -> str:
    return tiny_server.base


@pytest.fixture(scope="session")
def client(tiny_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_factory("llama")))
