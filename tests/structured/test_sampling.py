"""The pieces between the matchers and the sampler: the scheduler's readiness predicate, the
bitmask's rows in the runner's order, and the mask applied to the logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import SchedulerConfig
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.structured.manager import GrammarBitmask
from kvserve.worker.model_runner import _bitmask_rows
from kvserve.worker.sampler import Sampler, SamplingMetadata, apply_token_bitmask


def bitmask(rows: list[list[int]], vocab: int) -> np.ndarray:
    out = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.int32)
    for r, toks in enumerate(rows):
        for t in toks:
            out[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return out


def test_a_request_not_ready_waits_without_holding_up_others():
    ready = {"b"}
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                  is_ready=lambda rid: rid in ready)
    for rid in ("a", "b"):
        s.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), max_tokens=2))
    assert list(s.schedule().num_scheduled_tokens) == ["b"]
    assert [r.request_id for r in s.waiting] == ["a"]
    ready.add("a")
    assert list(s.schedule().num_scheduled_tokens) == ["a"]


def test_masked_tokens_become_minus_inf_and_full_rows_are_untouched():
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(3, vocab)
    mask = torch.from_numpy(bitmask([[0, 33, 69], [], [5]], vocab))
    mask[1] = -1  # an unconstrained row
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 33, 69]
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [5]


def test_a_row_allowing_nothing_is_left_alone():
    logits = torch.randn(1, 40)
    assert torch.equal(apply_token_bitmask(logits, torch.from_numpy(bitmask([[]], 40))), logits)


def test_the_sampler_picks_only_allowed_tokens_and_reports_masked_logprobs():
    vocab = 50
    logits = torch.randn(2, vocab)
    logits[:, 7] = 10.0  # the favourite, which the grammar forbids in row 0
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, logprobs=2)]
    mask = torch.from_numpy(bitmask([[3, 4], list(range(vocab))], vocab))
    meta = SamplingMetadata.build(params, [[], []], [[], []], {}, [[], []], vocab, torch.device("cpu"), mask)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist()[1] == 7
    assert out.sampled_token_ids.tolist()[0] == (3 if logits[0, 3] > logits[0, 4] else 4)
    lp = out.logprobs[0]
    assert torch.exp(lp[1:]).sum() == pytest.approx(1.0, abs=1e-5)  # the two allowed tokens hold all the mass


def test_bitmask_rows_follow_the_runner_order():
    g = GrammarBitmask(["x", "y"], bitmask([[1], [2]], 64))
    rows = _bitmask_rows(g, ["u", "y", "x"])
    assert rows[0].tolist() == [-1, -1]
    assert rows[1].tolist() == bitmask([[2]], 64)[0].tolist()
    assert rows[2].tolist() == bitmask([[1]], 64)[0].tolist()
    assert _bitmask_rows(g, ["u"]) is None and _bitmask_rows(None, ["x"]) is None


def test_the_bitmask_is_filled_off_the_engine_thread_and_waited_for_when_read():
    """The fill runs on the manager's mask thread while the forward runs; reading the rows (the
    sampler) and pickling them (an executor sending the step to its ranks) wait for it."""
    import pickle
    import threading
    from concurrent.futures import Future

    import numpy as np

    filled = Future()
    g = GrammarBitmask(["x"], np.zeros((1, 2), dtype=np.int32), filled)

    def fill():
        g._bitmask[0, 0] = 5
        filled.set_result(None)

    threading.Timer(0.05, fill).start()
    assert g.bitmask[0, 0] == 5  # waited for the fill
    later = Future()
    h = GrammarBitmask(["y"], np.zeros((1, 2), dtype=np.int32), later)
    threading.Timer(0.05, lambda: (h._bitmask.__setitem__((0, 1), 7), later.set_result(None))).start()
    copy = pickle.loads(pickle.dumps(h))
    assert copy.req_ids == ["y"] and copy.bitmask[0, 1] == 7
