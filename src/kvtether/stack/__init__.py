"""The process layer: start, watch and stop vLLM prefill/decode instances and the router.

Public surface (everything else in this package is private)::

    from kvtether.stack import Stack, StackSettings, start_reference_vllm

    with Stack(StackSettings(profile="cpu-tiny", prefill=1, decode=1)) as stack:
        ...  # stack.router_url, stack.prefill_urls, stack.decode_urls

    with start_reference_vllm(StackSettings()) as url:  # colocated, no prefix cache
        ...
"""

from __future__ import annotations

from kvtether.stack._control import InstanceStatus, stack_down, stack_status
from kvtether.errors import (
    InstanceFailedError,
    PortInUseError,
    RestartsExhaustedError,
    StackAlreadyRunningError,
    StackError,
    StackNotRunningError,
)
from kvtether.stack._reference import start_reference_vllm
from kvtether.stack.launcher import Stack
from kvtether.stack.models import prepare_model
from kvtether.stack.profiles import PROFILES, ProfileName
from kvtether.stack.settings import StackSettings, resolve_model

__all__ = [
    "Stack",
    "StackSettings",
    "PROFILES",
    "ProfileName",
    "InstanceStatus",
    "start_reference_vllm",
    "stack_status",
    "stack_down",
    "resolve_model",
    "prepare_model",
    "StackError",
    "PortInUseError",
    "StackAlreadyRunningError",
    "StackNotRunningError",
    "InstanceFailedError",
    "RestartsExhaustedError",
]
