"""What the router's parts share, built once by ``create_app``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtether.router._clock import Clock
from kvtether.router.backends import BackendPool
from kvtether.router.conversations import ConversationStore
from kvtether.router.leases import LeaseClient
from kvtether.router.metrics import RouterMetrics
from kvtether.router.settings import RouterSettings
from kvtether.router.tasks import TaskOwner

__all__ = ["RouterDeps"]


@dataclass(frozen=True)
class RouterDeps:
    settings: RouterSettings
    pool: BackendPool
    store: ConversationStore
    leases: LeaseClient
    metrics: RouterMetrics
    clock: Clock
    # Every task the router starts outside a request; the app's lifespan drains them.
    tasks: TaskOwner = field(default_factory=TaskOwner)
