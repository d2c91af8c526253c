"""The kvtether wire contract: headers, hints, reuse outcomes, session API and control messages.

The one package that the client session layer, the router and the vLLM connector all import.
Everything in ``__all__`` is public and versioned by ``PROTOCOL_VERSION``; change it only in
backward-compatible ways (new optional fields, new miss causes) unless the version changes.
Import names from here; the private modules hold one concept each:

* ``_wire``: the version, headers, body fields and the conversation-id rule;
* ``_outcome``: miss causes, the eligible/fired rule (``reuse_verdict``), ``ReuseOutcome``;
* ``_models``: client hints, the session API's bodies, ``TurnRecord`` and its timings;
* ``_errors``: OpenAI-style error bodies;
* ``_prefix``: prefix identity of token sequences and handle truncation;
* ``_control``: the connector's control channel.

Not exported: ``_kv_params``, the ``kv_transfer_params`` keys only the router and the connector
exchange (import them from ``kvtether.protocol._kv_params``).
"""

from __future__ import annotations

from kvtether.protocol._wire import (
    BODY_CONVERSATION_ID,
    BODY_HINTS,
    CONVERSATION_ID_CHARACTERS,
    CONVERSATION_ID_HEADER_ALIASES,
    HEADER_END,
    HEADER_PARENT_CONVERSATION_ID,
    conversation_id_problem,
    HEADER_CONVERSATION_ID,
    HEADER_DECODE_INSTANCE,
    HEADER_HINTS,
    HEADER_PROMPT_TOKENS,
    HEADER_REUSABLE_TOKENS,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_ROUTER,
    HEADER_SALVAGED_TOKENS,
    HEADER_TIMINGS,
    HEADER_TURN,
    KVTETHER_BODY_FIELDS,
    MAX_CONVERSATION_ID_LEN,
    PROTOCOL_VERSION,
)
from kvtether.protocol._outcome import (
    format_reuse_header,
    MissCause,
    NOT_ELIGIBLE_CAUSES,
    parse_reuse_header,
    reuse_verdict,
    ReuseOutcome,
)
from kvtether.protocol._models import (
    EngineTimings,
    HeartbeatRequest,
    HeartbeatResponse,
    parse_hints_header,
    parse_timings_header,
    Phase,
    SessionStatus,
    BranchStatus,
    TurnHints,
    TurnRecord,
    TurnTimings,
)
from kvtether.protocol._errors import (
    error_body,
    ErrorBody,
)
from kvtether.protocol._prefix import (
    block_hashes,
    reusable_prefix_tokens,
    tail_block_hash,
    truncate_handle,
)
from kvtether.protocol._control import (
    ConnectorStatus,
    CONTROL_API_PREFIX,
    CONTROL_SECRET_ENV,
    HandleResponse,
    IdleInfo,
    LeaseInfo,
    LeaseList,
    LeaseRenewRequest,
    PrefixCacheAnswer,
    PrefixCacheQuery,
    LeaseState,
    LeaseTotals,
    PREFILL_READ_MARGIN_S,
    PullOutcome,
)

__all__ = [
    "PROTOCOL_VERSION",
    "HEADER_CONVERSATION_ID",
    "CONVERSATION_ID_HEADER_ALIASES",
    "HEADER_END",
    "HEADER_PARENT_CONVERSATION_ID",
    "BODY_CONVERSATION_ID",
    "HEADER_HINTS",
    "BODY_HINTS",
    "HEADER_REUSE",
    "HEADER_REUSED_TOKENS",
    "HEADER_PROMPT_TOKENS",
    "HEADER_TURN",
    "HEADER_DECODE_INSTANCE",
    "HEADER_SALVAGED_TOKENS",
    "HEADER_ROUTER",
    "HEADER_REUSABLE_TOKENS",
    "HEADER_TIMINGS",
    "MAX_CONVERSATION_ID_LEN",
    "CONVERSATION_ID_CHARACTERS",
    "conversation_id_problem",
    "KVTETHER_BODY_FIELDS",
    "Phase",
    "MissCause",
    "NOT_ELIGIBLE_CAUSES",
    "ReuseOutcome",
    "reuse_verdict",
    "TurnHints",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "TurnRecord",
    "TurnTimings",
    "EngineTimings",
    "parse_timings_header",
    "SessionStatus",
    "BranchStatus",
    "ErrorBody",
    "error_body",
    "parse_reuse_header",
    "format_reuse_header",
    "parse_hints_header",
    "block_hashes",
    "reusable_prefix_tokens",
    "tail_block_hash",
    "CONTROL_API_PREFIX",
    "CONTROL_SECRET_ENV",
    "PREFILL_READ_MARGIN_S",
    "truncate_handle",
    "LeaseState",
    "PullOutcome",
    "LeaseRenewRequest",
    "PrefixCacheAnswer",
    "PrefixCacheQuery",
    "LeaseInfo",
    "LeaseTotals",
    "LeaseList",
    "HandleResponse",
    "ConnectorStatus",
    "IdleInfo",
]

