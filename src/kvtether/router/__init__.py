"""The kvtether router: an OpenAI-compatible ASGI app that routes each turn of a conversation
through a prefill instance and the conversation's decode instance, reusing decode-held KV."""

from __future__ import annotations

from kvtether.router.settings import RouterSettings

__all__ = ["RouterSettings", "create_app", "serve"]

# How long the router (and the front) keeps an idle client connection open. uvicorn's default,
# 5 s, equals the idle expiry of httpx's pool, which the OpenAI SDK and kvtether's clients use:
# with equal timers a client can send a turn on a connection the server is closing, and the turn
# fails before it left (APIConnectionError, which an SDK set not to retry hands to the agent).
# Longer than any such client's expiry, the client always closes first.
SERVER_KEEP_ALIVE_S = 75


def create_app(settings: RouterSettings, store=None, transport=None, clock=None):  # noqa: ANN001
    from kvtether.router.app import create_app as _create

    return _create(settings, store, transport, clock)


def serve(settings: RouterSettings) -> None:
    """Run the router in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )
