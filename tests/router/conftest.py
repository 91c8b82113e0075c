"""The replicas the router tests share: starting a `kvserve serve` takes seconds of both cores."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.router.router_procs import Replica, stop_all


@pytest.fixture(scope="package")
def cluster(tmp_path_factory) -> Iterator[list[Replica]]:
    """Three replicas of the default model with KV events on and small KV pools."""
    logs = tmp_path_factory.mktemp("replicas")
    reps = [Replica(logs / f"replica-{i}.log") for i in range(3)]
    try:
        for r in reps:
            r.start()
        with ThreadPoolExecutor(3) as ex:
            list(ex.map(Replica.wait_healthy, reps))
        yield reps
    finally:
        stop_all([r.proc for r in reps if r.proc is not None])
