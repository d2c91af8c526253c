"""The kvtether router: an OpenAI-compatible ASGI app that routes each turn of a conversation
through a prefill instance and the conversation's decode instance, reusing decode-held KV."""

from __future__ import annotations

from kvtether.router.settings import RouterSettings

__all__ = ["RouterSettings", "create_app", "serve"]


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
    )
