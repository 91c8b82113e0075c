"""The `ray` executor on a real two-node Ray cluster (two raylets on this machine): tensor
parallel across the nodes gives one rank's greedy tokens; too few CPUs is refused with the
counts; a killed rank's actor fails the next step naming the rank, and shutdown frees it all."""

from __future__ import annotations

import logging
import time

import pytest

from kvserve import LLM, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
IDS = [[5, 17, 42, 99, 7, 250, 3, 64], [11, 12, 13], [200, 100, 50, 25, 12, 6, 3, 1, 9, 8, 7, 6]]
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def cluster():
    """A head node and one more, one CPU each, so two ranks can only be placed one per node."""
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no reporting home from the test cluster
    c = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    try:
        c.add_node(**NODE_ARGS)
        ray.init(address=c.address, logging_level=logging.WARNING)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        mp.undo()


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32")
    try:
        return llm.generate(IDS, PARAMS, use_tqdm=False)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def ray_llm(cluster, tiny_model_factory):
    """TP=2 over the two nodes; test_killed_rank_* (last in this file) kills one of its ranks."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="ray")
    yield llm
    llm.close()


def _alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_too_few_cpus_is_refused_with_the_counts(cluster, tiny_model_factory, monkeypatch):
    from kvserve.distributed import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(RuntimeError, match=r"could not place 4 ranks .*4 CPUs.* 2 CPUs on 2 node\(s\), 2 free"):
        LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2,
            distributed_executor_backend="ray")


def test_tp2_across_two_nodes_matches_one_rank(ray_llm, reference):
    outs = ray_llm.generate(IDS, PARAMS, use_tqdm=False)
    for out, ref in zip(outs, reference):
        a, b = out.outputs[0], ref.outputs[0]
        assert len(a.token_ids) == PARAMS.max_tokens
        for j, (mine, theirs) in enumerate(zip(a.token_ids, b.token_ids)):
            if mine != theirs:  # sums over ranks add in another order: only a near-tie may flip
                top = b.logprobs[j]
                assert mine in top and abs(top[mine].logprob - top[theirs].logprob) < 1e-2, f"step {j}"
                break
            assert abs(a.logprobs[j][mine].logprob - b.logprobs[j][theirs].logprob) < 1e-3


def test_ranks_run_on_two_nodes_with_their_bundle_cpus(ray_llm):
    ex = ray_llm.engine.executor
    nodes = [n["node_id"] for n in ex.nodes]
    assert len(set(nodes)) == 2 and set(nodes) == _alive_node_ids()
    info = ex.collective_rpc("model_info")
    assert [i["pid"] for i in info] == [n["pid"] for n in ex.nodes]
    assert [i["threads"] for i in info] == [1, 1]  # one CPU per bundle


def test_killed_rank_fails_the_step_naming_it_and_shutdown_frees_all(ray_llm):
    from ray.util import placement_group_table

    from kvserve.distributed.executor import WorkerError

    ex = ray_llm.engine.executor
    ray.kill(ex.actors[1])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(Ray actor on node .*\) died"):
        ray_llm.generate(IDS, PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 30  # not the 60 s collective timeout of the surviving rank
    with pytest.raises(WorkerError, match="rank 1"):  # and stays failed, without hanging
        ray_llm.generate(IDS[:1], PARAMS, use_tqdm=False)
    ray_llm.close()
    for actor in ex.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
    assert placement_group_table(ex.placement_group)["state"] == "REMOVED"
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2  # nothing holds the cluster's CPUs any more
