"""Upstream's worker warns "Releasing expired KV blocks" for every send-side deadline that
passes; a lease kvtether ended (released, evicted) is not an expiry and is logged at DEBUG.
A lease that lapsed on its own keeps upstream's warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtether.connector import nixl  # noqa: E402
from kvtether.connector._compat.upstream import UPSTREAM_WORKER_LOGGER  # noqa: E402
from kvtether.connector.nixl import KVTetherWorker  # noqa: E402


def expiry_warning(request_id: str) -> logging.LogRecord:
    """The record upstream's ``_reap_expired_send_leases`` logs."""
    return logging.LogRecord(
        UPSTREAM_WORKER_LOGGER, logging.WARNING, __file__, 1,
        "Releasing expired KV blocks for request %s which were retrieved by %d remote "
        "worker(s) before lease expired.", (request_id, 0), None,
    )


def test_ended_leases_are_not_warned_about_and_lapsed_ones_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(KVTetherWorker.__mro__[1], "start_load_kv",
                        lambda self, metadata: started.append(metadata))
    monkeypatch.setattr(nixl._ENDED_BY_KVTETHER, "ended", type(nixl._ENDED_BY_KVTETHER.ended)(
        maxsize=16, ttl=300.0))
    worker = object.__new__(KVTetherWorker)
    meta = SimpleNamespace(scheduler_clock=100.0,
                           reqs_to_send={"released": 99.5, "at-clock": 100.0, "renewed": 160.0})
    worker.start_load_kv(meta)
    assert started == [meta]  # upstream still gets the step's metadata

    quiet = nixl._ENDED_BY_KVTETHER
    assert not quiet.filter(expiry_warning("released"))
    assert not quiet.filter(expiry_warning("at-clock"))
    assert quiet.filter(expiry_warning("renewed"))  # its deadline lapsed later, on its own
    assert quiet.filter(expiry_warning("released"))  # marked once, for the step that freed it
    other = logging.LogRecord("x", logging.WARNING, __file__, 1, "other %s", ("released",), None)
    assert quiet.filter(other)


def test_the_filter_sits_on_upstream_s_worker_logger_once() -> None:
    upstream = logging.getLogger(UPSTREAM_WORKER_LOGGER)
    nixl.quiet_ended_leases()
    nixl.quiet_ended_leases()
    assert upstream.filters.count(nixl._ENDED_BY_KVTETHER) == 1
