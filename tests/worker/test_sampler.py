"""Sampler tests: every filter, penalty and logprob against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from kvserve.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_banned,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)

CPU = torch.device("cpu")
NEG = float("-inf")


def build(params, vocab, prompts=None, outputs=None, generators=None, banned=None):
    b = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts or [[] for _ in range(b)],
        output_token_ids=outputs or [[] for _ in range(b)],
        generators=generators or {},
        banned_token_ids=banned or [[] for _ in range(b)],
        vocab_size=vocab,
        device=CPU,
    )


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


# --------------------------------------------------------------------------- metadata

def test_build_metadata_neutral_values_are_none():
    meta = build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)], vocab=10)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.presence_penalty is None and meta.frequency_penalty is None
    assert meta.repetition_penalty is None and meta.max_num_logprobs is None
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert not meta.all_greedy and not meta.all_random


def test_build_metadata_values():
    params = [SamplingParams(top_k=3, top_p=0.9, logprobs=2, repetition_penalty=1.2),
              SamplingParams(top_k=-1, min_p=0.1, logprobs=5, presence_penalty=0.5),
              SamplingParams(temperature=0.0, top_k=2)]
    meta = build(params, vocab=10)
    assert meta.top_k.tolist() == [3, 10, 10]  # greedy row neutral
    assert meta.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert meta.repetition_penalty.tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert meta.presence_penalty.tolist() == pytest.approx([0.0, 0.5, 0.0])
    assert meta.frequency_penalty is None
    assert meta.max_num_logprobs == 5
    assert meta.top_k.dtype == torch.int64 and meta.top_p.dtype == torch.float32


# --------------------------------------------------------------------------- greedy

def test_all_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    meta = build([SamplingParams(temperature=0.0)] * 6, vocab=50)
    assert meta.all_greedy
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_greedy_row_next_to_random_rows():
    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(4, vocab) * 3
    params = [SamplingParams(temperature=1.5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0, seed=5), SamplingParams(temperature=0.0)]
    expected_greedy = logits.argmax(-1)
    seen_random = set()
    for step in range(30):
        gens = {2: torch.Generator().manual_seed(step)}
        out = Sampler()(logits, build(params, vocab, generators=gens))
        ids = out.sampled_token_ids
        assert ids[1] == expected_greedy[1] and ids[3] == expected_greedy[3]
        seen_random.add(int(ids[0]))
    assert len(seen_random) > 1  # the random row really samples


def test_sampler_does_not_modify_input_logits():
    logits = torch.randn(2, 20)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=3, top_p=0.5, repetition_penalty=2.0),
              SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    Sampler()(logits, build(params, 20, prompts=[[1, 2], [3]], outputs=[[4], [5, 5]], banned=[[0], [1]]))
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- filters

def test_top_k_keeps_exactly_the_k_best():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5, 2.5],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    top_k = torch.tensor([3, 1, 6])  # 6 = vocab = disabled
    out = apply_top_k_top_p(logits, top_k, None)
    assert kept(out[0]) == {1, 3, 5}
    assert kept(out[1]) == {0}
    assert kept(out[2]) == set(range(6))
    # kept entries are unchanged
    assert torch.equal(out[0, [1, 3, 5]], logits[0, [1, 3, 5]])


def test_top_k_sampling_only_returns_top_k():
    torch.manual_seed(2)
    vocab = 30
    logits = torch.randn(1, vocab)
    best = set(torch.topk(logits[0], 4).indices.tolist())
    seen = set()
    for seed in range(300):
        params = [SamplingParams(temperature=5.0, top_k=4, seed=seed)]
        gens = {0: torch.Generator().manual_seed(seed)}
        seen.add(int(Sampler()(logits, build(params, vocab, generators=gens)).sampled_token_ids[0]))
    assert seen == best


@pytest.mark.parametrize("top_p,expected", [
    (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.5, {0}), (0.3, {0}), (0.95, {0, 1, 2}),
    (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    out = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    assert kept(out[0]) == expected


@pytest.mark.parametrize("probs,top_p,expected", [
    ([0.45, 0.3, 0.2, 0.05], 0.75, {0, 1}),  # float32 mass of {0,1} is 0.74999994
    ([0.45, 0.3, 0.2, 0.05], 0.95, {0, 1, 2}),
    ([0.6, 0.25, 0.1, 0.05], 0.85, {0, 1}),
])
def test_top_p_float_rounding_does_not_add_a_token(probs, top_p, expected):
    out = apply_top_k_top_p(logits_from_probs(probs), None, torch.tensor([top_p]))
    assert kept(out[0]) == expected


def test_top_p_unsorted_vocab_and_batch():
    logits = torch.cat([logits_from_probs([0.05, 0.3, 0.15, 0.5]),
                        logits_from_probs([0.25, 0.25, 0.25, 0.25]),
                        logits_from_probs([0.1, 0.2, 0.3, 0.4])])
    out = apply_top_k_top_p(logits, None, torch.tensor([0.8, 0.6, 1.0]))
    assert kept(out[0]) == {3, 1}
    assert kept(out[1]) == {0, 1, 2, 3}  # ties with the last kept token stay
    assert kept(out[2]) == {0, 1, 2, 3}


def test_top_k_then_top_p():
    # top_k=3 renormalises [0.5, 0.3, 0.15] -> [0.526, 0.316, 0.158]; top_p 0.8 keeps {0, 1}
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05]).repeat(2, 1)
    out = apply_top_k_top_p(logits, torch.tensor([3, 2]), torch.tensor([0.8, 0.99]))
    assert kept(out[0]) == {0, 1}
    assert kept(out[1]) == {0, 1}  # top_k binds before top_p


def test_min_p_keeps_tokens_above_fraction_of_max():
    logits = torch.cat([logits_from_probs([0.5, 0.3, 0.15, 0.05]),
                        logits_from_probs([0.05, 0.5, 0.3, 0.15]),
                        logits_from_probs([0.5, 0.3, 0.15, 0.05])])
    out = apply_min_p(logits, torch.tensor([0.35, 0.2, 0.0]))
    assert kept(out[0]) == {0, 1}  # cutoff 0.175
    assert kept(out[1]) == {1, 2, 3}  # cutoff 0.1
    assert kept(out[2]) == {0, 1, 2, 3}


def test_filters_respected_by_full_sampler():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05]).repeat(3, 1)
    params = [SamplingParams(top_p=0.8), SamplingParams(min_p=0.35), SamplingParams(top_k=1)]
    seen = [set(), set(), set()]
    for seed in range(200):
        gens = {i: torch.Generator().manual_seed(seed * 3 + i) for i in range(3)}
        ids = Sampler()(logits, build(params, 4, generators=gens)).sampled_token_ids
        for i in range(3):
            seen[i].add(int(ids[i]))
    assert seen == [{0, 1}, {0, 1}, {0}]


def test_temperature_sharpens_distribution():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1]).repeat(2000, 1)
    cold = Sampler()(logits, build([SamplingParams(temperature=0.1)] * 2000, 4)).sampled_token_ids
    hot = Sampler()(logits, build([SamplingParams(temperature=1.0)] * 2000, 4)).sampled_token_ids
    # T=0.1: p(0) = 0.4^10 / sum ~ 0.94; T=1: p(0) = 0.4
    assert (cold == 0).float().mean() > 0.85
    assert 0.3 < (hot == 0).float().mean() < 0.5


def test_sampling_frequencies_match_probabilities():
    torch.manual_seed(3)
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 20000
    ids = Sampler()(logits_from_probs(probs).repeat(n, 1), build([SamplingParams()] * n, 4)).sampled_token_ids
    freq = torch.bincount(ids, minlength=4).float() / n
    assert freq.tolist() == pytest.approx(probs, abs=0.02)


# --------------------------------------------------------------------------- penalties

def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(frequency_penalty=-0.5)]
    prompts = [[0, 1], [2]]
    outputs = [[3, 3, 1], [4, 4, 4]]
    meta = build(params, 5, prompts=prompts, outputs=outputs)
    out = apply_penalties(logits.clone(), meta)
    # row 0: repetition on {0,1,3} (prompt+output); output counts: 3->2, 1->1
    expected0 = [2.0 / 2, -1.0 * 2 - 0.5 * 1 - 0.25, 0.5, 3.0 / 2 - 0.5 * 2 - 0.25, -2.0]
    # row 1: repetition 1.0 (none), frequency -0.5 * count; presence 0
    expected1 = [1.0, 1.0, 1.0, 1.0, 1.0 + 0.5 * 3]
    assert out[0].tolist() == pytest.approx(expected0)
    assert out[1].tolist() == pytest.approx(expected1)


def test_penalties_with_repeated_tokens_and_banned():
    logits = torch.tensor([[1.0, -0.5, 2.0, 0.0]])
    params = [SamplingParams(repetition_penalty=1.25, frequency_penalty=0.1, presence_penalty=0.3)]
    meta = build(params, 4, prompts=[[2, 2, 1]], outputs=[[2, 1, 2, 2]], banned=[[3]])
    got = apply_penalties(apply_banned(logits.clone(), meta.banned_token_ids), meta)
    # repetition is applied once per token however often it was seen
    expected = [1.0, -0.5 * 1.25 - 0.1 * 1 - 0.3, 2.0 / 1.25 - 0.1 * 3 - 0.3, NEG]
    assert got[0].tolist() == pytest.approx(expected)


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    meta = build([SamplingParams(temperature=0.0, repetition_penalty=1.5)], 3, outputs=[[0]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1]
    meta = build([SamplingParams(temperature=0.0, presence_penalty=0.2)], 3, outputs=[[0]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1]
    meta = build([SamplingParams(temperature=0.0)], 3, outputs=[[0]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0]


# --------------------------------------------------------------------------- seeds

def _run_seeded(batch_params, row, steps, vocab, logits_seq, seeds):
    """Run `steps` steps; seeds maps row -> seed. Returns the ids sampled at `row`."""
    gens = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
    picked = []
    for step in range(steps):
        logits = logits_seq[step].expand(len(batch_params), vocab)
        out = Sampler()(logits, build(batch_params, vocab, generators=gens))
        picked.append(int(out.sampled_token_ids[row]))
    return picked


def test_seeded_row_independent_of_batch_composition():
    vocab, steps = 64, 8
    torch.manual_seed(4)
    logits_seq = [torch.randn(1, vocab) for _ in range(steps)]
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=123)
    alone = _run_seeded([target], 0, steps, vocab, logits_seq, {0: 123})
    batch_a = [SamplingParams(temperature=0.9, seed=7), SamplingParams(), target,
               SamplingParams(temperature=0.0)]
    in_a = _run_seeded(batch_a, 2, steps, vocab, logits_seq, {0: 7, 2: 123})
    batch_b = [target, SamplingParams(top_k=5), SamplingParams(temperature=2.0, seed=99)]
    in_b = _run_seeded(batch_b, 0, steps, vocab, logits_seq, {0: 123, 2: 99})
    assert alone == in_a == in_b
    # and another seed gives a different sequence
    other = _run_seeded([target], 0, steps, vocab, logits_seq, {0: 124})
    assert other != alone


def test_seeded_draws_survive_last_bit_differences_in_the_logits():
    """A prompt computed fresh and one read from the prefix cache give logits that differ in the
    last bits; a seeded row should still draw the same token. The exponential race moves only when
    two candidates' ratios are that close (0 of 400 rows here at 1e-3 noise on the logits); an
    inverse-transform draw, whose boundary sums the whole vocabulary's differences, moved 33."""
    from kvserve.worker.sampler import random_sample

    n, vocab = 400, 4096
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=gen) * 2.0
    nudged = logits + 1e-3 * torch.randn(n, vocab, generator=gen)
    picks = [random_sample(x.softmax(-1), {i: torch.Generator().manual_seed(i) for i in range(n)})
             for x in (logits, nudged)]
    assert int((picks[0] != picks[1]).sum()) <= 2


def test_unseeded_rows_do_not_disturb_seeded_rows_under_global_rng():
    vocab = 32
    logits = torch.randn(3, vocab)
    params = [SamplingParams(), SamplingParams(seed=1), SamplingParams()]
    results = []
    for global_seed in (10, 20):
        torch.manual_seed(global_seed)
        gens = {1: torch.Generator().manual_seed(1)}
        results.append(int(Sampler()(logits, build(params, vocab, generators=gens)).sampled_token_ids[1]))
    assert results[0] == results[1]


# --------------------------------------------------------------------------- logprobs

def test_logprobs_layout_and_ranks():
    torch.manual_seed(5)
    vocab = 50
    logits = torch.randn(4, vocab) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=1.0, logprobs=5, seed=3),
              SamplingParams(temperature=0.5, top_k=10),
              SamplingParams(temperature=0.0, logprobs=0)]
    meta = build(params, vocab, prompts=[[int(logits[0].argmax())], [], [], []],
                 generators={1: torch.Generator().manual_seed(3)})
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top_vals, top_ids = torch.topk(raw, 5, dim=-1)
    assert torch.allclose(out.logprobs[:, 1:], top_vals)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert bool((out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all())  # sorted descending
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = [int((order[i] == sampled[i]).nonzero()) + 1 for i in range(4)]
    assert out.sampled_ranks.tolist() == expected_ranks
    # row 0: greedy on penalised logits picks a token that is not the raw best
    assert out.sampled_ranks[0] == 2 and out.sampled_ranks[3] == 1


def test_logprobs_are_raw_not_penalised_or_tempered():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    params = [SamplingParams(temperature=0.3, top_k=1, logprobs=2, frequency_penalty=1.0)]
    out = Sampler()(logits, build(params, 4, outputs=[[0]], banned=[[1]]))
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.sampled_token_ids.tolist() == [2]
    assert out.logprobs[0].tolist() == pytest.approx([raw[2].item(), raw[2].item(), raw[1].item()])
    assert out.logprob_token_ids[0].tolist() == [2, 2, 1]  # banned token still reported in top-K
    assert math.isclose(torch.exp(out.logprobs[0, 0]).item(), 1 / (1 + math.e ** -1 + math.e ** -2 + math.e ** -3),
                        rel_tol=1e-5)


def test_rank_ties_share_the_better_rank():
    logits = torch.tensor([[1.0, 1.0, 0.0]])
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=1)], 3))
    assert out.sampled_token_ids.tolist() == [0]  # argmax takes the first of ties
    assert out.sampled_ranks.tolist() == [1]
    vals, ids, ranks = compute_prompt_logprobs(logits, torch.tensor([1]), 2)
    assert ranks.tolist() == [1]
    assert vals[0, 0].item() == pytest.approx(vals[0, 1].item())


def test_compute_prompt_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(7, 30)
    targets = torch.tensor([0, 5, 29, 3, 3, 10, 1])
    vals, ids, ranks = compute_prompt_logprobs(logits, targets, 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert vals.shape == (7, 5) and ids.shape == (7, 5) and ranks.shape == (7,)
    assert torch.equal(ids[:, 0], targets)
    assert torch.allclose(vals[:, 0], raw[torch.arange(7), targets])
    tv, ti = torch.topk(raw, 4, dim=-1)
    assert torch.allclose(vals[:, 1:], tv) and torch.equal(ids[:, 1:], ti)
    expected = (raw > raw[torch.arange(7), targets][:, None]).sum(-1) + 1
    assert ranks.tolist() == expected.tolist()
    vals0, ids0, _ = compute_prompt_logprobs(logits, targets, 0)
    assert vals0.shape == (7, 1) and torch.equal(ids0[:, 0], targets)


# --------------------------------------------------------------------------- banned

def test_banned_tokens_never_sampled():
    vocab = 8
    # token 0 dominates; ban it (and 1) on row 0, ban 5 on row 1 (greedy)
    logits = torch.tensor([[10.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    banned = [[0, 1], [5]]
    for seed in range(200):
        gens = {0: torch.Generator().manual_seed(seed)}
        ids = Sampler()(logits, build(params, vocab, generators=gens, banned=banned)).sampled_token_ids
        assert int(ids[0]) not in (0, 1)
        assert int(ids[1]) == 6


def test_banned_tokens_with_high_temperature_and_penalties():
    vocab = 5
    logits = torch.zeros(64, vocab)
    params = [SamplingParams(temperature=100.0, frequency_penalty=-2.0, repetition_penalty=0.5)] * 64
    meta = build(params, vocab, outputs=[[2, 2, 2]] * 64, banned=[[2, 4]] * 64)
    ids = Sampler()(logits, meta).sampled_token_ids
    assert set(ids.tolist()) <= {0, 1, 3}


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), build([], 10))
    assert out.sampled_token_ids.shape == (0,)


# --------------------------------------------------------------------------- reference

def _reference_top_k_top_p(logits, top_k, top_p):
    """Row-by-row full-sort reference (the slow, obvious way)."""
    out = logits.clone()
    for i in range(logits.size(0)):
        row = logits[i]
        order = row.argsort(descending=True).tolist()
        keep = order[: int(top_k[i])]
        probs = row[keep].softmax(-1).tolist()
        mass, nucleus = 0.0, []
        for tok, p in zip(keep, probs):
            if nucleus and float(top_p[i]) < 1.0 and mass >= float(top_p[i]) - 1e-6:
                break
            nucleus.append(tok)
            mass += p
        drop = torch.ones_like(row, dtype=torch.bool)
        drop[nucleus] = False
        out[i][drop] = NEG
    return out


def test_top_p_stages_settle_each_row_at_its_own_stage():
    """One batch whose nuclei need the first candidate stage (a peaked row), the second (a
    broader one) and the full sort (a flat one), beside a top-k row: every row's kept set is the
    full-sort reference's, whichever stage settled it."""
    vocab = 5000
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(5, vocab, generator=gen, dtype=torch.float64).float()
    logits = torch.stack([base[0] * 8.0, base[1] * 2.5, base[2] * 0.01, base[3] * 3.0, base[4] * 2.5])
    top_k = torch.tensor([vocab, vocab, vocab, 40, vocab])
    top_p = torch.tensor([0.9, 0.95, 0.9, 0.8, 0.95])
    probs = logits.softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    need = [int((probs[i] < top_p[i]).sum()) + 1 for i in range(5)]
    assert need[0] <= 64 < need[1] <= 1024 < need[2]  # the three stages are all exercised
    out = apply_top_k_top_p(logits, top_k, top_p)
    ref = _reference_top_k_top_p(logits, top_k, top_p)
    for i in range(5):
        assert kept(out[i]) == kept(ref[i]), i


@pytest.mark.parametrize("vocab,scale", [(50, 3.0), (5000, 3.0), (5000, 0.01)])
def test_top_k_top_p_matches_reference(vocab, scale):
    # scale 0.01 makes a flat distribution whose nucleus is far beyond the candidate set
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen, dtype=torch.float64).float() * scale
    top_k = torch.tensor([vocab, 3, vocab, min(2000, vocab), 1, vocab])
    top_p = torch.tensor([0.9, 0.7, 1.0, 0.95, 0.5, 0.3])
    out = apply_top_k_top_p(logits, top_k, top_p)
    ref = _reference_top_k_top_p(logits, top_k, top_p)
    for i in range(6):
        assert kept(out[i]) == kept(ref[i]), i
