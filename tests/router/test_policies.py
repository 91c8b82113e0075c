"""The router's cache-aware policies (kv_aware, approx) and the shared prompt encoding, without
processes: replicas are ReplicaViews whose block mirrors a real KVCacheManager filled."""

from __future__ import annotations

import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from kvserve.core.kv_events import STORED, BlockMirror, KVEvent, KVEventPublisher, KVEventSink, KVEventSubscriber
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.prefix_cache import max_cached_blocks
from kvserve.request import Request
from kvserve.router.approx import ApproxPolicy, TextRadixTree
from kvserve.router.kv_aware import KVAwarePolicy, prompt_block_hashes
from kvserve.router.policy import POLICIES, ReplicaView, RouteRequest
from kvserve.sampling_params import SamplingParams
from kvserve.server.prompts import PromptError, chat_prompt_ids, completion_prompt_ids
from tests.serving import free_port

BS = 4


class MirrorSubscriber:
    """Stands in for a KVEventSubscriber: the same BlockMirror.match over a mirror we fill."""

    def __init__(self, mirror: BlockMirror) -> None:
        self.mirror = mirror

    def match(self, hashes: list[bytes]) -> list[str]:
        return self.mirror.match(hashes)


def cache_prompts(prompts: list[list[int]], salt: str | None = None) -> tuple[KVCacheManager, BlockMirror]:
    """An engine's KV manager that served `prompts` (blocks now idle, still cached), and the
    mirror its KV events build: exactly what a router holds for that replica."""
    m = KVCacheManager(64, BS)
    sink = KVEventSink()
    m.attach_events(sink)
    for i, toks in enumerate(prompts):
        r = Request(f"r{i}", toks, SamplingParams(), cache_salt=salt)
        assert m.allocate_slots(r, len(toks)) is not None
        m.free(r)
    m.check_integrity()
    mirror = BlockMirror()
    for ev in sink.take():
        mirror.apply(ev)
    return m, mirror


def replica(url: str, mirror: BlockMirror | None = None, **load) -> ReplicaView:
    return ReplicaView(url, kv_events=MirrorSubscriber(mirror) if mirror is not None else None,  # type: ignore[arg-type]
                       block_size=BS, **load)


def tok_req(tokens: list[int], salt: str | None = None) -> RouteRequest:
    return RouteRequest("completion", {}, token_ids=tokens, num_prompt_tokens=len(tokens), cache_salt=salt)


def tiered_mirror(hashes: list[bytes], medium: str, m: BlockMirror | None = None, parent: bytes = b"") -> BlockMirror:
    """A mirror holding a chain of blocks in one medium (added to `m` after `parent` if given)."""
    m = m if m is not None else BlockMirror()
    for h in hashes:
        m.apply(KVEvent(STORED, medium, h, parent))
        parent = h
    return m


SYSTEM = list(range(100, 124))  # 6 blocks shared by a "system prompt"


# ---- kv_aware -------------------------------------------------------------------------


@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("n", [3, 4, 15, 16, 17])
def test_prompt_block_hashes_are_the_engines(n: int, salt: str | None):
    toks = [random.Random(n).randrange(300) for _ in range(n)]
    m, mirror = cache_prompts([toks], salt)
    r = Request("q", toks, SamplingParams(), cache_salt=salt)
    ours = prompt_block_hashes(toks, BS, salt)
    assert len(ours) == max_cached_blocks(r, BS) == (n - 1) // BS  # never the last token's block
    # The engine's own lookup of the same prompt finds every block and hashes them as we do ...
    assert m.num_cached_blocks(r) == len(ours)
    assert r.block_hashes[:len(ours)] == ours
    # ... and its KV events carried exactly these hashes.
    assert mirror.match(ours) == ["device"] * len(ours)
    assert set(ours) <= set(mirror.blocks["device"])
    other = prompt_block_hashes(toks, BS, "tenant-b" if salt else "x")
    assert len(other) == len(ours) and not set(other) & set(ours)  # the salt separates tenants


def test_replica_holding_the_prefix_wins_and_reports_the_engines_hit():
    cached = SYSTEM + [1, 2, 3, 4, 5]
    m, mirror = cache_prompts([cached])
    _, other = cache_prompts([[7] * 40])
    reps = [replica("a", other), replica("b", mirror), replica("c")]
    prompt = SYSTEM + [1, 2, 3, 9, 9, 9, 9, 9]
    d = KVAwarePolicy(seed=0).choose(tok_req(prompt), reps)
    assert d.replica.url == "b" and d.reason == "cache_hit"
    # What the router promises is what the engine then reuses: 6 system blocks, then [1, 2, 3, 9] differs.
    assert d.cached_tokens == m.num_cached_blocks(Request("x", prompt, SamplingParams())) * BS == 24
    assert d.extra["cached_tiers"] == {"device": 6}
    # Another salt is another tenant's cache: no hit anywhere.
    d = KVAwarePolicy(seed=0).choose(tok_req(prompt, salt="t2"), reps)
    assert d.reason == "no_hit" and d.cached_tokens == 0


def test_device_beats_cpu_beats_disk_beats_remote_beats_nothing():
    prompt = SYSTEM + [1]
    hashes = prompt_block_hashes(prompt, BS, None)
    reps = {m: replica(m, tiered_mirror(hashes, m)) for m in ("device", "cpu", "disk", "remote")}
    reps["none"] = replica("none", BlockMirror())
    policy = KVAwarePolicy(seed=1)
    for best in ("device", "cpu", "disk", "remote"):
        for _ in range(5):
            d = policy.choose(tok_req(prompt), list(reps.values()))
            assert d.replica.url == best and d.reason == "cache_hit" and d.cached_tokens == len(SYSTEM)
        del reps[best]
    assert policy.choose(tok_req(prompt), list(reps.values())).reason == "no_hit"


def test_lower_tier_hits_mix_with_device_hits_block_by_block():
    prompt = SYSTEM + [1]
    hashes = prompt_block_hashes(prompt, BS, None)
    split = tiered_mirror(hashes[3:], "disk", tiered_mirror(hashes[:3], "device"), parent=hashes[2])
    # 3 device + 3 disk blocks (3 + 1.5 saved) beat 5 cpu blocks (4 saved) but lose to 6 cpu blocks (4.8).
    five_cpu = tiered_mirror(hashes[:5], "cpu")
    d = KVAwarePolicy().choose(tok_req(prompt), [replica("split", split), replica("cpu5", five_cpu)])
    assert d.replica.url == "split" and d.extra["cached_tiers"] == {"device": 3, "disk": 3}
    d = KVAwarePolicy().choose(tok_req(prompt), [replica("split", split), replica("cpu6", tiered_mirror(hashes, "cpu"))])
    assert d.replica.url == "cpu6"


def test_load_outweighs_a_small_hit_but_not_a_large_one():
    prompt = SYSTEM + [1]
    hashes = prompt_block_hashes(prompt, BS, None)
    policy = KVAwarePolicy(seed=0)
    # One cached block saves 4 tokens; 3 queued decode streams cost 48: go to the idle replica.
    small = replica("small", tiered_mirror(hashes[:1], "device"), decode_streams=3)
    d = policy.choose(tok_req(prompt), [small, replica("idle", BlockMirror())])
    assert d.replica.url == "idle" and d.reason == "load" and d.cached_tokens == 0
    # All six blocks (24 tokens) against 20 tokens of queued prefill: the hit wins.
    big = replica("big", tiered_mirror(hashes, "device"), pending_prefill_tokens=20)
    d = policy.choose(tok_req(prompt), [big, replica("idle", BlockMirror())])
    assert d.replica.url == "big" and d.reason == "cache_hit"
    big.pending_prefill_tokens = 30
    assert policy.choose(tok_req(prompt), [big, replica("idle", BlockMirror())]).replica.url == "idle"


def test_balance_thresholds_route_by_load_alone():
    prompt = list(range(801))  # 200 blocks, all cached on "hot": saves 800 tokens of prefill there
    hashes = prompt_block_hashes(prompt, BS, None)
    policy = KVAwarePolicy(seed=0, balance_abs_threshold=100, balance_rel_threshold=1.5)
    hot = replica("hot", tiered_mirror(hashes, "device"), pending_prefill_tokens=300)
    cool = replica("cool", BlockMirror(), pending_prefill_tokens=0)
    # The cost prefers hot (1 + 300 < 801 + 0), but the gap 300 > 100 and 300 > 1.5 * 0.
    d = policy.choose(tok_req(prompt), [hot, cool])
    assert d.replica.url == "cool" and d.reason == "balance" and d.cached_tokens == 0
    cool.pending_prefill_tokens = 250  # gap 50: under the absolute threshold
    assert policy.choose(tok_req(prompt), [hot, cool]).reason == "cache_hit"
    hot.pending_prefill_tokens, cool.pending_prefill_tokens = 700, 500  # gap 200 but ratio 1.4
    assert policy.choose(tok_req(prompt), [hot, cool]).reason == "cache_hit"
    hot.pending_prefill_tokens = 760  # ratio 1.52: both thresholds crossed
    assert policy.choose(tok_req(prompt), [hot, cool]).reason == "balance"
    # Under balance the chosen replica's cached blocks are still reported.
    hot.pending_prefill_tokens, cool.pending_prefill_tokens = 0, 1000
    d = policy.choose(tok_req(prompt), [hot, cool])
    assert d.replica.url == "hot" and d.reason == "balance" and d.cached_tokens == 800
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        KVAwarePolicy(balance_rel_threshold=0.5)


def test_ties_are_broken_at_random_and_the_seed_repeats_them():
    reps = [replica(f"r{i}", BlockMirror()) for i in range(4)]
    policy = KVAwarePolicy(seed=3)
    picks = [policy.choose(tok_req([5] * 30), reps).replica.url for _ in range(400)]
    counts = Counter(picks)
    assert set(counts) == {"r0", "r1", "r2", "r3"} and min(counts.values()) > 60
    again = KVAwarePolicy(seed=3)
    assert [again.choose(tok_req([5] * 30), reps).replica.url for _ in range(400)] == picks


def test_no_token_ids_falls_back_to_least_load():
    reps = [replica("a", BlockMirror(), pending_prefill_tokens=50), replica("b", None, decode_streams=2),
            replica("c", BlockMirror(), pending_prefill_tokens=40)]
    d = KVAwarePolicy().choose(RouteRequest("chat", {}, text="hi"), reps)
    assert d.replica.url == "b" and d.reason == "no_tokens" and d.cached_tokens == 0  # 2 streams = 32 tokens
    assert POLICIES["kv_aware"] is KVAwarePolicy and KVAwarePolicy.needs_tokens


def test_kv_aware_over_real_kv_events():
    """Engine KV manager -> KVEventPublisher -> ZMQ -> KVEventSubscriber -> the policy."""
    pub_addr, replay_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sink = KVEventSink()
    m = KVCacheManager(64, BS)
    m.attach_events(sink)
    pub = KVEventPublisher(sink, pub_addr, replay_addr, "fp", BS)
    sub = KVEventSubscriber(pub_addr, replay_addr)
    try:
        assert sub.synced.wait(10)
        r = Request("r", SYSTEM + [1, 2], SamplingParams())
        m.allocate_slots(r, r.num_tokens)
        m.free(r)
        deadline = time.monotonic() + 10
        while len(sub.mirror.blocks["device"]) < 6:
            assert time.monotonic() < deadline, "the events did not arrive"
            time.sleep(0.02)
        reps = [ReplicaView("cold", block_size=BS), ReplicaView("warm", kv_events=sub, block_size=sub.header["block_size"])]
        d = KVAwarePolicy(seed=0).choose(tok_req(SYSTEM + [3, 3, 3]), reps)
        assert d.replica.url == "warm" and d.cached_tokens == 24
    finally:
        sub.close()
        pub.close()


# ---- approx ---------------------------------------------------------------------------


def text_req(text: str) -> RouteRequest:
    return RouteRequest("completion", {}, text=text, num_prompt_tokens=len(text) // 4)


def route(policy: ApproxPolicy, text: str, replicas: list[ReplicaView]) -> str:
    req = text_req(text)
    d = policy.choose(req, replicas)
    policy.on_routed(req, d)
    return d.replica.url


def test_radix_tree_matches_splits_and_merges():
    t = TextRadixTree()
    for s in ("hello world", "hello there", "help", "hello world, again"):
        t.insert(s)
        t.check_integrity()
    assert t.match("hello wor") == 9 and t.match("helpful") == 4 and t.match("hex") == 2 and t.match("") == 0
    assert t.match("hello world, again and again") == 18 and t.match("xyz") == 0
    # "hel" -> ("lo " -> ("world, again", "there"), "p"): the leaf "world" grew, no chain of nodes.
    assert t.num_nodes == 5 and t.size == 3 + 3 + 12 + 5 + 1


def test_radix_tree_evicts_least_recently_used_leaves():
    t = TextRadixTree(max_chars=30)
    for s in ("a" * 10, "b" * 10, "c" * 10):
        t.insert(s)
    t.insert("a" * 10)  # a is used again: b is now the oldest
    t.insert("d" * 10)
    t.check_integrity()
    assert (t.match("a" * 10), t.match("b" * 10), t.match("c" * 10), t.match("d" * 10)) == (10, 0, 10, 10)
    # Evicting one branch of a split merges the other back into one edge.
    t = TextRadixTree(max_chars=12)
    t.insert("xxxxA12")
    t.insert("xxxxB34")  # xxxx + A12 + B34 = 10 characters
    t.insert("zzz")  # 13 > 12: the oldest leaf (A12) goes, xxxx and B34 merge
    t.check_integrity()
    assert t.match("xxxxA12") == 4 and t.match("xxxxB34") == 7 and t.num_nodes == 2 and t.size == 10
    t.insert("q" * 50)  # longer than the cap: its first 12 characters, everything else evicted
    t.check_integrity()
    assert t.match("q" * 50) == 12 and t.size == 12


def test_radix_tree_against_brute_force():
    rng = random.Random(0)
    t, big = TextRadixTree(max_chars=200), TextRadixTree()
    inserted: list[str] = []
    for _ in range(600):
        s = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 25)))
        t.insert(s)
        big.insert(s)
        inserted.append(s)
        assert t.match(s) == len(s)  # what was just sent is always held
        q = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 25)))
        expect = max((len(_common(q, x)) for x in inserted), default=0)
        assert big.match(q) == expect and t.match(q) <= expect
    t.check_integrity()
    big.check_integrity()
    assert t.size <= 200 and big.size == sum(len(n.label) for n in big._nodes())


def _common(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]


def test_approx_routes_by_longest_prefix_and_spreads_new_prefixes():
    reps = [ReplicaView("a"), ReplicaView("b"), ReplicaView("c")]
    policy = ApproxPolicy(seed=0)
    first = {route(policy, p * 20, reps) for p in ("alpha ", "beta ", "gamma ")}
    assert first == {"a", "b", "c"}  # each new prefix goes to an empty tree
    owner = route(policy, "beta " * 20, reps)
    for _ in range(10):
        d = policy.choose(text_req("beta " * 20 + "question?"), reps)
        assert d.replica.url == owner and d.reason == "cache_hit" and d.extra["matched_chars"] == 100
        assert d.cached_tokens == (len("beta " * 20 + "question?") // 4) * 100 // 109
    for tree in policy.trees.values():
        tree.check_integrity()


def test_approx_threshold_and_smallest_tree():
    reps = [ReplicaView("a"), ReplicaView("b")]
    policy = ApproxPolicy(seed=0, cache_threshold=0.5)
    policy.on_routed(text_req("x" * 100), policy.choose(text_req("x" * 100), reps[:1]))
    # 40 of 100 characters shared: below the threshold, the new text goes to the smaller tree.
    d = policy.choose(text_req("x" * 40 + "y" * 60), reps)
    assert d.replica.url == "b" and d.reason == "no_hit" and d.cached_tokens == 0
    d = policy.choose(text_req("x" * 60 + "y" * 40), reps)
    assert d.replica.url == "a" and d.reason == "cache_hit"
    strict = ApproxPolicy(cache_threshold=0.8)
    strict.trees = policy.trees
    assert strict.choose(text_req("x" * 60 + "y" * 40), reps).replica.url == "b"
    policy.on_routed(text_req("z" * 10), policy.choose(text_req("z" * 10), [reps[1]]))
    assert policy.choose(text_req("new text"), reps).replica.url == "b"  # 10 chars < 100
    assert policy.choose(text_req(""), reps).reason == "no_hit"
    with pytest.raises(ValueError, match="cache_threshold"):
        ApproxPolicy(cache_threshold=1.5)


def test_approx_balance_and_replica_removal():
    reps = [ReplicaView("a"), ReplicaView("b", pending_prefill_tokens=10)]
    policy = ApproxPolicy(seed=0, balance_abs_threshold=50)
    for _ in range(3):
        route(policy, "shared prefix " * 10, reps[:1])
    assert policy.choose(text_req("shared prefix " * 10), reps).reason == "cache_hit"
    reps[0].pending_prefill_tokens = 100  # gap 90 > 50 and 100 > 1.5 * 10
    d = policy.choose(text_req("shared prefix " * 10), reps)
    assert d.replica.url == "b" and d.reason == "balance"
    reps[0].pending_prefill_tokens = 0
    policy.on_replica_removed("a")
    assert "a" not in policy.trees
    d = policy.choose(text_req("shared prefix " * 10), reps)
    assert d.reason == "no_hit"
    assert POLICIES["approx"] is ApproxPolicy and not ApproxPolicy.needs_tokens


def test_approx_tree_cap_forgets_old_prefixes():
    reps = [ReplicaView("a")]
    policy = ApproxPolicy(max_tree_chars=100)
    for p in ("one ", "two ", "three "):
        route(policy, p * 10, reps)
    tree = policy.trees["a"]
    tree.check_integrity()
    assert tree.size <= 100 and tree.match("one " * 10) == 0 and tree.match("three " * 10) == 60


# ---- prompts --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import make_tokenizer

    return make_tokenizer()


RAW_MESSAGES = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "The quick brown "}, {"type": "text", "text": "fox?"}],
     "name": "ann"},
    {"role": "assistant", "content": None},
    {"role": "user", "content": "Prefix caching reuses the KV cache."},
]


def test_chat_prompt_ids_are_the_servers(tokenizer):
    from kvserve.server import protocol as P
    from kvserve.server.serving_chat import ChatServing

    ours = chat_prompt_ids(tokenizer, RAW_MESSAGES)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox?"},
             {"role": "assistant", "content": ""}, {"role": "user", "content": "Prefix caching reuses the KV cache."}]
    ref = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours == list(ref["input_ids"])
    assert tokenizer.decode(ours).endswith("<|im_start|>assistant\n")
    # The server's path (validated pydantic messages) gives the same ids for the same raw body.
    serving = object.__new__(ChatServing)  # only the tokenizer and the context length build the prompt
    serving.tokenizer, serving.info = tokenizer, SimpleNamespace(max_model_len=2048, num_kv_blocks=64, block_size=16)
    assert serving.chat_ids(P.ChatCompletionRequest(messages=RAW_MESSAGES).messages) == ours


def test_prompt_errors_name_the_field(tokenizer):
    from kvserve.server import protocol as P
    from kvserve.server.serving import APIError
    from kvserve.server.serving_chat import ChatServing

    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(PromptError, match="only text content parts") as e:
        chat_prompt_ids(tokenizer, image)
    assert e.value.param == "messages" and isinstance(e.value, ValueError)
    serving = object.__new__(ChatServing)
    serving.tokenizer, serving.info = tokenizer, SimpleNamespace(max_model_len=2048, num_kv_blocks=64, block_size=16)
    with pytest.raises(APIError) as api:
        serving.chat_ids(P.ChatCompletionRequest(messages=image).messages)
    assert (api.value.status, api.value.message, api.value.param) == (400, "only text content parts are supported",
                                                                      "messages")
    bad_order = [{"role": "user", "content": "a"}]
    strict = object.__new__(type(tokenizer))
    strict.__dict__.update(tokenizer.__dict__)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(PromptError, match="the chat template rejected the messages: .*roles must alternate"):
        chat_prompt_ids(strict, bad_order)
    strict.chat_template = None
    with pytest.raises(PromptError, match="no chat template; use /v1/completions"):
        chat_prompt_ids(strict, bad_order)


def test_completion_prompt_ids(tokenizer):
    text = "The quick brown fox"
    ids = list(tokenizer(text)["input_ids"])
    assert completion_prompt_ids(tokenizer, text) == ([ids], [text])
    assert completion_prompt_ids(tokenizer, [text, "fox"]) == ([ids, list(tokenizer("fox")["input_ids"])], [text, "fox"])
    assert completion_prompt_ids(tokenizer, [1, 2, 3]) == ([[1, 2, 3]], [None])
    assert completion_prompt_ids(tokenizer, [[1, 2], [3]]) == ([[1, 2], [3]], [None, None])
    for bad, msg in (([], "must not be empty"), ([{"a": 1}], "must be a string"), ([[1, "x"]], "must be a string")):
        with pytest.raises(PromptError, match=msg) as e:
            completion_prompt_ids(tokenizer, bad)
        assert e.value.param == "prompt"


def test_router_hashes_a_tool_request_as_the_replica_renders_it(tokenizer):
    """The tools are part of the prompt the replica computes (its chat template or kvserve's
    default tool format): the router's token ids for routing include them too."""
    from kvserve.router.proxy import prompt_token_ids

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = prompt_token_ids("chat", {"messages": msgs, "tools": tools}, tokenizer)
    assert with_tools == [chat_prompt_ids(tokenizer, msgs, tools=tools)]
    assert with_tools != prompt_token_ids("chat", {"messages": msgs}, tokenizer)
    assert prompt_token_ids("chat", {"messages": msgs, "tools": "nonsense"}, tokenizer) == \
        prompt_token_ids("chat", {"messages": msgs}, tokenizer)
