"""vLLM's offline API on a tiny model: prompt dicts, lists of conversations, and the model's
sampling defaults (generation_config / get_default_sampling_params)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_proc import ready_message
from kvserve.inputs import TextPrompt, TokensPrompt

TEXT = "The quick brown fox jumps over the lazy dog."
# A model's recommended sampling (HF names): greedy, with a top_k and a repetition penalty.
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3, "max_new_tokens": 12,
                     "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}
MODEL_DEFAULTS = SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.3, max_tokens=12)


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **kw})


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64, max_model_len=128,
               check_integrity=True)


@pytest.fixture(scope="module")
def gen_dir(tiny_model_factory, tmp_path_factory):
    """The tiny llama with a generation_config.json holding sampling defaults."""
    path = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(tiny_model_factory("llama"), path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


# ---- prompt dicts -------------------------------------------------------------------


def test_prompt_dicts_match_plain_prompts(llm):
    toks = ids(20, 1)
    plain = llm.generate([TEXT, toks, "Paged attention", ids(9, 2)], greedy(), use_tqdm=False)
    dicts = llm.generate([TextPrompt(prompt=TEXT), TokensPrompt(prompt_token_ids=toks), "Paged attention",
                          {"prompt_token_ids": ids(9, 2)}], greedy(), use_tqdm=False)
    assert tokens(dicts) == tokens(plain)
    assert [o.prompt for o in dicts] == [TEXT, None, "Paged attention", None]
    assert [o.prompt_token_ids for o in dicts] == [o.prompt_token_ids for o in plain]
    assert [o.outputs[0].text for o in dicts] == [o.outputs[0].text for o in plain]


def test_single_prompt_dict_and_token_ids_with_text(llm):
    toks = list(llm.get_tokenizer()(TEXT)["input_ids"])
    (alone,) = llm.generate({"prompt_token_ids": toks}, greedy(), use_tqdm=False)
    (text,) = llm.generate({"prompt": TEXT}, greedy(), use_tqdm=False)
    # Both keys: the ids run, the text is what the output reports (vLLM's TokensPrompt).
    (both,) = llm.generate({"prompt_token_ids": toks, "prompt": "shown"}, greedy(), use_tqdm=False)
    assert alone.outputs[0].token_ids == text.outputs[0].token_ids == both.outputs[0].token_ids
    assert both.prompt == "shown" and both.prompt_token_ids == toks
    assert "".join(llm.stream({"prompt": TEXT}, greedy())) == text.outputs[0].text


def test_prompt_dict_cache_salt_separates_prefix_cache(llm):
    toks = ids(48, 3)
    llm.engine.kv.reset_prefix_cache()
    llm.generate({"prompt_token_ids": toks}, greedy(max_tokens=1), use_tqdm=False)
    again = llm.generate({"prompt_token_ids": toks}, greedy(max_tokens=1), use_tqdm=False)[0]
    salted = llm.generate({"prompt_token_ids": toks, "cache_salt": "tenant-a"}, greedy(max_tokens=1),
                          use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and salted.num_cached_tokens == 0


@pytest.mark.parametrize("bad, match", [
    ({"prompt": TEXT, "foo": 1}, r"prompts\[1\]: unknown key 'foo' in a prompt dict"),
    ({"prompt": TEXT, "multi_modal_data": {"image": None}},
     r"prompts\[1\]: 'multi_modal_data' is not supported: kvserve runs text-only models"),
    ({"prompt_embeds": [[0.0]]}, r"prompts\[1\]: 'prompt_embeds' is not supported"),
    ({"cache_salt": "x"}, r"prompts\[1\]: a prompt dict needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": 5}, r"prompts\[1\]: 'prompt' must be a string, got int"),
    ({"prompt": ""}, r"prompts\[1\]: prompt must not be empty"),
    ({"prompt_token_ids": "1 2 3"}, r"prompts\[1\]: 'prompt_token_ids' must be a list of token ids, got str"),
    ({"prompt_token_ids": [1, "x"]}, r"prompts\[1\]: prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": [1, 10**6]}, r"prompts\[1\]: prompt_token_ids contains 1000000"),
    ({"prompt": TEXT, "cache_salt": 3}, r"prompts\[1\]: 'cache_salt' must be a string"),
])
def test_bad_prompt_dict_names_index_and_key(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([TEXT, bad], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued


# ---- chat over a list of conversations -----------------------------------------------


def test_chat_list_of_conversations_equals_one_by_one(llm):
    convs = [[{"role": "user", "content": "Hello there"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}],
             [{"role": "user", "content": "Paged attention"}]]
    batch = llm.chat(convs, greedy(), use_tqdm=False)
    single = [llm.chat(c, greedy(), use_tqdm=False)[0] for c in convs]
    assert len(batch) == 3
    assert tokens(batch) == tokens(single)
    assert [o.prompt_token_ids for o in batch] == [o.prompt_token_ids for o in single]
    assert [o.prompt_token_ids for o in batch] == [llm.apply_chat_template(c) for c in convs]


@pytest.mark.parametrize("messages, match", [
    ([[{"role": "user", "content": "hi"}], {"role": "user", "content": "hi"}],
     r"messages mixes messages and conversations \(messages\[0\] is a list, messages\[1\] a dict\)"),
    ([{"role": "user", "content": "hi"}, [{"role": "user", "content": "hi"}]],
     r"messages mixes messages and conversations \(messages\[0\] is a dict, messages\[1\] a list\)"),
    ([], "messages must be a non-empty list"),
    ([[{"role": "user", "content": "hi"}], [{"content": "no role"}]], r"messages\[1\]: messages must be a list of"),
])
def test_chat_bad_messages(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- the model's sampling defaults ---------------------------------------------------


def test_no_sampling_keys_means_plain_defaults(llm):
    # The tiny model's generation_config.json has only token ids: nothing to apply.
    assert llm.engine.generation_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    assert ready_message(llm.engine, llm.config)["generation_defaults"] == {}


def test_generation_config_auto_applies_when_params_omitted(gen_dir, caplog):
    with caplog.at_level("WARNING", logger="kvserve.models.generation_config"):
        llm = LLM(model=str(gen_dir), dtype="float32", num_kv_blocks=64, max_model_len=64)
    assert "sampling defaults from the model's" in caplog.text and "temperature=0.0" in caplog.text
    assert llm.engine.generation_defaults == {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3,
                                              "max_tokens": 12}
    assert llm.get_default_sampling_params() == MODEL_DEFAULTS
    assert ready_message(llm.engine, llm.config)["generation_defaults"] == llm.engine.generation_defaults
    prompts = [TEXT, ids(10, 4)]
    omitted = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, MODEL_DEFAULTS, use_tqdm=False)
    assert tokens(omitted) == tokens(explicit)
    chat = [{"role": "user", "content": TEXT}]
    assert tokens(llm.chat(chat, use_tqdm=False)) == tokens(llm.chat(chat, MODEL_DEFAULTS, use_tqdm=False))
    assert "".join(llm.stream(TEXT)) == omitted[0].outputs[0].text
    # The model's max_tokens (12) is cut to the room a long prompt leaves in max_model_len=64.
    (long,) = llm.generate([ids(60, 5)], use_tqdm=False)
    assert 1 <= len(long.outputs[0].token_ids) <= 4
    # A caller's own SamplingParams is taken whole, as in vLLM.
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        llm.generate([ids(60, 5)], SamplingParams(max_tokens=12), use_tqdm=False)


@pytest.mark.parametrize("setting", ["none", "vllm"])
def test_generation_config_none_ignores_model_defaults(gen_dir, setting):
    llm = LLM(model=str(gen_dir), dtype="float32", num_kv_blocks=16, max_model_len=64, generation_config=setting)
    assert llm.engine.generation_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    assert ready_message(llm.engine, llm.config)["generation_defaults"] == {}


def test_generation_config_folder(tiny_model_factory, gen_dir):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=16, max_model_len=64,
              generation_config=str(gen_dir))
    assert llm.get_default_sampling_params() == MODEL_DEFAULTS


def test_generation_config_bad_folder(tiny_model_factory, tmp_path):
    with pytest.raises(ValueError, match="must be auto, none, or a directory holding generation_config.json"):
        LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=16,
            generation_config=str(tmp_path))


def test_cli_sampling_flags_over_model_defaults_over_fallbacks():
    """`kvserve generate` / `chat`: a flag given wins, then the model's default, then the CLI's own."""
    import argparse

    from kvserve.cli import add_sampling_args, sampling_from_args

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    model = {"temperature": 0.6, "top_k": 20, "max_tokens": 4096}
    plain = sampling_from_args(p.parse_args([]))
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (0.0, -1, 128)
    from_model = sampling_from_args(p.parse_args([]), model)
    assert (from_model.temperature, from_model.top_k, from_model.max_tokens) == (0.6, 20, 128)
    given = sampling_from_args(p.parse_args(["--temperature", "0", "--max-tokens", "7"]), model)
    assert (given.temperature, given.top_k, given.max_tokens) == (0.0, 20, 7)
