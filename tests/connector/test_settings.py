"""Connector settings from ``kv_connector_extra_config`` (no vLLM import)."""

from __future__ import annotations

import pytest

from kvtether.connector._settings import ConnectorSettings
from kvtether.errors import ConfigError


def test_settings_read_kvtether_keys_only() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"bidirectional_kv_xfer": True, "kvtether_control_port": 5901,
         "kvtether_lease_ttl_s": 45, "kvtether_role": "decode"},
        env={},
    )
    assert settings.control_port == 5901
    assert settings.lease_ttl_s == 45.0
    assert settings.role == "decode"
    assert settings.max_retained_tokens is None


def test_control_port_falls_back_to_env() -> None:
    settings = ConnectorSettings.from_extra_config({}, env={"KVTETHER_CONTROL_PORT": "5955"})
    assert settings.control_port == 5955
    assert ConnectorSettings.from_extra_config(None, env={}).control_port is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"kvtether_lease_ttl_s": -3}, "kvtether_lease_ttl_s"),
     ({"kvtether_control_port": 70000}, "kvtether_control_port")],
)
def test_bad_settings_name_the_key(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ConnectorSettings.from_extra_config(extra, env={})
