"""``@session.tool``, ``session.tool_call(...)`` and ``@session.step``.

A tool run is timed, fed to the predictor, attached to the turn whose reply asked for it, and
accompanied by lease heartbeats. Steps number the agent loop's iterations. Both decorators
accept sync functions, coroutine functions, and sync and async generator functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Generator
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from kvtether.session._heartbeat import Beat, HeartbeatPlan
from kvtether.session._predict import tool_key
from kvtether.session._records import ToolRun
from kvtether.session._state import CURRENT_STEP

if TYPE_CHECKING:
    from kvtether.session._state import SessionState

__all__ = ["ToolCall", "StepScope", "StartHeartbeat", "decorate", "bound_arguments"]

F = TypeVar("F", bound=Callable[..., Any])

# Starts the heartbeat of one tool run (the twin's I/O): (plan, in_task) -> the running beat.
# ``in_task``: entered with ``async with``, so an asyncio task can beat next to the tool.
StartHeartbeat = Callable[[HeartbeatPlan, bool], Beat]


class ToolCall:
    """One tool run: ``with session.tool_call("grep", eta_s=5):`` or ``async with ...``.

    The body is timed, heartbeats keep the lease alive while it runs, and they stop when the
    body returns, raises or is cancelled; the exception itself always reaches the caller.
    Exported as the type ``session.tool_call()`` returns; get one from that method (the
    constructor's arguments are the session's internals).
    """

    def __init__(
        self,
        state: SessionState,
        start_heartbeat: StartHeartbeat,
        name: str,
        *,
        eta_s: float | None = None,
        args: Any = None,
    ) -> None:
        self._state = state
        self._start_heartbeat = start_heartbeat
        self.name = name
        self._eta_s = eta_s
        self._key = tool_key(name, args)
        self.run: ToolRun | None = None
        self._beat: Beat | None = None
        self._t0 = 0.0

    def _start(self, *, in_task: bool) -> ToolRun:
        if self.run is not None:
            raise RuntimeError("a tool_call() context can be entered only once")
        self.run = self._state.tool_started(self.name, self._key, self._eta_s)
        self._t0 = self._state.clock()
        plan = HeartbeatPlan(self._state, self.run, self._eta_s)
        if plan.wanted:  # no lease yet (or no kvtether router): nothing to keep alive
            self._beat = self._start_heartbeat(plan, in_task)
        return self.run

    def _finish(self, exc: BaseException | None) -> None:
        assert self.run is not None
        # A consumer that stops iterating a generator tool early is no failure of the tool.
        failed = exc is not None and not isinstance(exc, GeneratorExit)
        error = type(exc).__name__ if failed else None
        self._state.tool_finished(self.run, self._state.clock() - self._t0, error)

    # The same run, for code that sees a tool start and end in two callbacks rather than
    # around one block (framework hooks): begin() / end() from sync code (a thread beats),
    # abegin() / aend() from a coroutine (a task beats). ``error``: what the tool raised.
    def begin(self) -> ToolRun:
        """Start the run (heartbeats in a thread); pair it with :meth:`end`."""
        return self._start(in_task=False)

    def end(self, error: BaseException | None = None) -> None:
        """End a run started with :meth:`begin`."""
        self.__exit__(None if error is None else type(error), error, None)

    async def abegin(self) -> ToolRun:
        """Start the run (heartbeats in an asyncio task); pair it with :meth:`aend`."""
        return self._start(in_task=True)

    async def aend(self, error: BaseException | None = None) -> None:
        """End a run started with :meth:`abegin`."""
        await self.__aexit__(None if error is None else type(error), error, None)

    def __enter__(self) -> ToolRun:
        return self._start(in_task=False)

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._beat is not None:
                self._beat.stop()
        finally:
            self._finish(exc)

    async def __aenter__(self) -> ToolRun:
        return self._start(in_task=True)

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._beat is not None:
                await self._beat.astop()
        finally:
            self._finish(exc)


class StepScope:
    """Marks code as one iteration of the agent loop; requests made in it carry its number."""

    def __init__(self, state: SessionState) -> None:
        self._state = state
        self._token: Token[tuple[int, int] | None] | None = None
        self.step = 0

    def __enter__(self) -> int:
        self.step = self._state.next_step()
        self._token = CURRENT_STEP.set((id(self._state), self.step))
        return self.step

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            try:
                CURRENT_STEP.reset(self._token)
            except ValueError:  # a generator resumed in another context: just clear it
                CURRENT_STEP.set(None)

    async def __aenter__(self) -> int:
        return self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        self.__exit__(*exc_info)


def decorate(fn: F, scope: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> F:
    """Run every call of ``fn`` inside ``scope(args, kwargs)``, whatever kind of callable."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def agen_wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
            async with scope(args, kwargs):
                gen = fn(*args, **kwargs)
                try:
                    value = await gen.__anext__()
                    while True:
                        try:
                            sent = yield value
                        except GeneratorExit:
                            raise
                        except BaseException as exc:  # noqa: BLE001 - forwarded to fn
                            value = await gen.athrow(exc)
                        else:
                            value = await gen.asend(sent)
                except StopAsyncIteration:
                    return
                finally:
                    await gen.aclose()

        return agen_wrapper  # type: ignore[return-value]

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            async with scope(args, kwargs):
                return await fn(*args, **kwargs)

        return async_wrapper  # type: ignore[return-value]

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            with scope(args, kwargs):
                return (yield from fn(*args, **kwargs))

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with scope(args, kwargs):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def bound_arguments(fn: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """Maps a call's arguments to ``{name: value}`` (``self``/``cls`` dropped) for tool_key."""
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if signature is None:
            return list(args) + list(kwargs.values())
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return list(args) + list(kwargs.values())
        return {k: v for k, v in bound.items() if k not in ("self", "cls")}

    return arguments
