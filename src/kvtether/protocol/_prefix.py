"""Prefix identity of token sequences: common prefixes, block hashes, and cutting a handle to
whole blocks."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from typing import Any

from kvtether.protocol._kv_params import KV_PARAM_BLOCK_HASHES, KV_PARAM_TAIL_HASH


# --- prefix identity ----------------------------------------------------------------------
def block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Chained hashes of each full block of ``token_ids``: equal hash i ⇔ equal first i+1 blocks."""
    out: list[str] = []
    prev = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(",".join(map(str, token_ids[start : start + block_size])).encode())
        prev = h.digest()
        out.append(prev.hex())
    return out


def matching_prefix_tokens(cached: Sequence[int], prompt: Sequence[int], block_size: int) -> int:
    """Tokens of ``cached`` that ``prompt`` repeats exactly, rounded down to whole blocks.

    Never more than ``len(prompt) - 1``: the last prompt token must be computed to sample from.
    """
    n = min(len(cached), len(prompt) - 1)
    i = 0
    while i < n and cached[i] == prompt[i]:
        i += 1
    return (i // block_size) * block_size


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (any int sequences)."""
    n = min(len(a), len(b))
    # Compare in chunks (C speed), then token by token inside the first differing chunk.
    chunk, i = 1024, 0
    while i + chunk <= n and list(a[i : i + chunk]) == list(b[i : i + chunk]):
        i += chunk
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable_prefix_tokens(built: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt tokens an earlier turn computed KV for: the common prefix of ``prompt`` and the
    sequence that turn ``built`` (its prompt + output), less that sequence's last token, whose
    KV no engine computed (a sequence ends when that token is sampled)."""
    return common_prefix_tokens(built[:-1], prompt) if built else 0


def tail_block_hash(token_ids: Sequence[int], block_size: int) -> str | None:
    """Hash of the trailing partial block of ``token_ids``, chained on its full blocks.

    ``None`` when ``len(token_ids)`` is a multiple of ``block_size`` (no partial block).
    Equal tail hashes mean equal ``token_ids`` (the chain covers every earlier block).
    """
    n_full = len(token_ids) // block_size
    if len(token_ids) == n_full * block_size:
        return None
    chain = block_hashes(token_ids[: n_full * block_size], block_size)
    h = hashlib.blake2b(bytes.fromhex(chain[-1]) if chain else b"", digest_size=16)
    # A distinct separator keeps a tail from ever colliding with a full block's hash.
    h.update(b"tail:" + ",".join(map(str, token_ids[n_full * block_size :])).encode())
    return h.hexdigest()


def truncate_handle(
    params: dict[str, Any], n_blocks: int, block_size: int
) -> dict[str, Any] | None:
    """A copy of a decode handle cut to its first ``n_blocks`` blocks; ``None`` if it cannot be.

    Only single-group handles are cut. Hybrid models (sliding-window or mamba layers) keep only
    a window's tail in some KV cache groups, so "the first n blocks" is not the same tokens in
    every group there: such a handle is read whole or not at all, never cut (never wrong KV).
    """
    groups = params.get("remote_block_ids")
    if (not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], list)
            or n_blocks <= 0):
        return None
    cut = copy.deepcopy(params)
    cut["remote_block_ids"] = [list(groups[0][:n_blocks])]
    cut["remote_num_tokens"] = n_blocks * block_size
    # The prefix identity travels with the cut: a prefill checking the hashes against
    # remote_num_tokens would otherwise find them inconsistent and read nothing.
    hashes = cut.get(KV_PARAM_BLOCK_HASHES)
    if isinstance(hashes, list):
        cut[KV_PARAM_BLOCK_HASHES] = hashes[:n_blocks]
    cut.pop(KV_PARAM_TAIL_HASH, None)  # whole blocks only now: no partial tail block
    return cut
