"""The server against its own OpenAPI schema (issue 31): schemathesis generates requests for every
operation the schema documents, valid and invalid, and sends them to a real `kvserve serve`.

Every response must be a documented status with a body that conforms to the schema, never a 5xx,
and the server must stay healthy. After the run the engine holds nothing: no request running or
waiting, no KV block in use. Examples per operation are bounded (FUZZ_EXAMPLES, default 12) so
the run fits CI on 2 cores; the server's small max-model-len and max-n bound each generation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode, checks  # noqa: E402
from schemathesis.openapi import from_url  # noqa: E402

from tests.serving import TINY_SERVER_ARGS, http_request, metric_values, running_server  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
SERVER_ARGS = [*TINY_SERVER_ARGS, "--max-model-len", "192"]
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with running_server(SERVER_ARGS, Path(tmp_path_factory.mktemp("fuzz")) / "server.log") as srv:
        yield srv


def _fuzz(operation, mode: GenerationMode, base: str, server) -> None:  # noqa: ANN001
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:  # noqa: ANN001
        case.call_and_validate(base_url=base, checks=CHECKS, timeout=120)
        assert http_request("GET", f"{base}/health", timeout=10)[0] == 200, server.log_text()[-3000:]

    run()


def test_every_operation_answers_as_documented(server) -> None:  # noqa: ANN001
    """Valid and invalid requests for each operation (schemathesis' pytest plugin does not load
    under pytest 9, so the operations are driven through hypothesis here)."""
    schema = from_url(f"{server.base}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, server.base, server)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to get wrong: no inputs
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - every operation runs; failures listed together
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)


def test_nothing_left_in_the_engine_after_the_run(server) -> None:  # noqa: ANN001
    """Runs after the fuzzing (pytest keeps a module's order): every request finished or aborted."""
    deadline = time.monotonic() + 30
    while True:
        m = metric_values(server.base)
        left = {k: m[k] for k in ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
                                  "kvserve:kv_cache_usage_perc") if m.get(k)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, left
