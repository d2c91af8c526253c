"""The public surface: names, ids, URLs, settings, and a light `import kvtether`."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvtether
import kvtether.session
from kvtether.errors import (
    ConfigError,
    KVTetherError,
    KVTetherWarning,
    MissingConversationKeyWarning,
    PrefixBreakWarning,
    RouterUnavailableError,
    SessionError,
    SessionGone,
    SessionNotFound,
)
from kvtether.session import Session, SessionSettings, conversation_id_from


def test_exported_names_are_pinned() -> None:
    assert kvtether.__all__ == [
        "Session",
        "AsyncSession",
        "SessionPool",
        "AsyncSessionPool",
        "KVTetherError",
        "__version__",
    ]
    assert kvtether.__version__ == "0.1.0"
    assert kvtether.Session is kvtether.session.Session
    assert kvtether.SessionPool is kvtether.session.SessionPool
    assert kvtether.AsyncSessionPool is kvtether.session.AsyncSessionPool
    assert sorted(kvtether.session.__all__) == sorted(
        [
            "Session",
            "AsyncSession",
            "SessionPool",
            "AsyncSessionPool",
            "SessionSettings",
            "ToolCall",
            "Turn",
            "ToolRun",
            "SessionEvent",
            "SessionTotals",
            "EventKind",
            "PrefixCheck",
            "PrefixStatus",
            "PrefixBreakWarning",
            "MissingConversationKeyWarning",
            "ConfigError",
            "RouterUnavailableError",
            "SessionError",
            "SessionNotFoundError",
            "SessionGoneError",
            "GrowthPredictor",
            "Prediction",
            "tool_key",
            "conversation_id_from",
            "new_conversation_id",
            "keep_prefix_stable",
            "normalize_message",
        ]
    )
    for name in kvtether.session.__all__:
        assert getattr(kvtether.session, name) is not None


def test_error_tree() -> None:
    import kvtether.errors as errors
    import kvtether.stack

    for cls in (ConfigError, RouterUnavailableError, SessionError):
        assert issubclass(cls, KVTetherError)
    # Every public exception is one of errors.py's, under KVTetherError, named ...Error (the
    # two older session names are the same classes), and exported where it is raised.
    for name in errors.__all__:
        cls = getattr(errors, name)
        if issubclass(cls, Warning):
            assert issubclass(cls, KVTetherWarning) or cls is KVTetherWarning
            continue
        assert issubclass(cls, KVTetherError), name
        assert cls.__name__.endswith("Error"), name
    assert SessionNotFound is errors.SessionNotFoundError and SessionGone is errors.SessionGoneError
    assert kvtether.session.SessionGoneError is errors.SessionGoneError
    assert kvtether.stack.RestartsExhaustedError is errors.RestartsExhaustedError
    from kvtether.bench.scenario import ScenarioError
    from kvtether.connector import VLLMVersionError

    assert issubclass(ScenarioError, ConfigError)
    assert issubclass(VLLMVersionError, errors.UnsupportedVersionError)
    assert issubclass(VLLMVersionError, ImportError)
    assert issubclass(SessionNotFound, SessionError) and issubclass(SessionGone, SessionError)
    assert issubclass(ConfigError, ValueError)  # bad arguments stay catchable as ValueError
    assert issubclass(PrefixBreakWarning, UserWarning)
    assert issubclass(MissingConversationKeyWarning, KVTetherWarning)


def test_import_kvtether_does_not_load_the_sdk_or_the_session_layer() -> None:
    code = (
        "import sys, kvtether; "
        "assert 'openai' not in sys.modules, 'openai'; "
        "assert 'kvtether.session' not in sys.modules, 'session'; "
        "from kvtether import Session; "
        "assert 'openai' not in sys.modules, 'openai after Session'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_conversation_id_from_a_thread_id_is_stable_and_private() -> None:
    a = conversation_id_from("thread-42", "alice@example.com")
    assert a == conversation_id_from("thread-42", "alice@example.com")
    assert a != conversation_id_from("thread-4", "2alice@example.com")
    assert a != conversation_id_from("thread-42", "alice@example.com", namespace="other-app")
    assert "alice" not in a and a.startswith("kvt-")
    assert Session.from_thread_id("thread-42", "alice@example.com").conversation_id == a


def test_generated_ids_differ_and_given_ids_are_kept() -> None:
    assert Session().conversation_id != Session().conversation_id
    assert Session(conversation_id="my-run.7").conversation_id == "my-run.7"


@pytest.mark.parametrize("bad", ["", "has space", "new\nline", "x" * 300, "é"])
def test_ids_that_cannot_travel_as_headers_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="conversation_id"):
        Session(conversation_id=bad)


@pytest.mark.parametrize(
    "url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"]
)
def test_base_url_accepts_the_router_root_or_its_v1(url: str) -> None:
    assert Session(url).base_url == "http://h:8000"


def test_bad_base_url_says_what_to_pass() -> None:
    with pytest.raises(ConfigError, match="router's address"):
        Session("localhost:8000")


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_SESSION_HEARTBEAT_INTERVAL_S", "1.5")
    monkeypatch.setenv("KVTETHER_SESSION_BASE_URL", "http://r:9/v1")
    s = Session()
    assert s.base_url == "http://r:9"
    assert SessionSettings().heartbeat_interval_s == 1.5


def test_invalid_env_setting_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_SESSION_HEARTBEAT_INTERVAL_S", "-1")
    with pytest.raises(ConfigError, match="KVTETHER_SESSION_"):
        Session()


def test_wrap_refuses_what_is_not_an_openai_client() -> None:
    with pytest.raises(ConfigError, match=r"openai\.OpenAI"):
        Session("http://h:1").wrap(object())
