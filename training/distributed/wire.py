"""What the nodes send each other besides tensors: JSON (never pickle), bounded, and checked against what is
expected before use. A message that is not what it should be is `Malformed`: one line naming the node."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from typing import Any

from training.distributed.env import NodeLost

MAX_MESSAGE_BYTES = 64 * 2**20  # a fingerprint of a large target is a few MB; nothing sent is larger
_STEP_DIR = re.compile(r"^step_\d{8}$")


class Malformed(NodeLost):
    """A node sent something that is not what this run's nodes send: the run stops (exit 6), using none of it."""


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes, rank: int, what: str, check: Callable[[Any], None]) -> Any:
    """`data` from node `rank` as JSON, passed by `check` (which raises ValueError saying what is wrong)."""
    try:
        value = json.loads(data.decode())
        check(value)
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as err:
        raise Malformed(f"node {rank} sent a malformed {what} ({type(err).__name__}: {str(err)[:200]}): "
                        "refusing it (a stranger, or a trainer of another version)") from None
    return value


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sums(value: Any, what: str) -> None:
    _need(isinstance(value, dict), f"{what} is not an object")
    for name, pair in value.items():
        _need(isinstance(pair, list) and len(pair) == 2 and all(_number(v) for v in pair),
              f"{what}[{name!r}] is not a pair of numbers")


def check_fingerprint(value: Any) -> None:
    """run_fingerprint's shape."""
    _need(isinstance(value, dict) and set(value) == {"config", "data", "target", "target_weights",
                                                     "drafter_weights"}, "not a run fingerprint")
    _need(isinstance(value["config"], dict) and isinstance(value["data"], dict), "config or data is not an object")
    _need(isinstance(value["target"], str), "target is not a string")
    _sums(value["target_weights"], "target_weights")
    _sums(value["drafter_weights"], "drafter_weights")


def check_figures(rank: int) -> Callable[[Any], None]:
    """Nodes.combine_figures' record of node `rank`."""
    def check(value: Any) -> None:
        _need(isinstance(value, dict) and set(value) == {"node", "tokens_per_s", "tflops_per_s", "busy",
                                                         "all_reduce_ms"}, "not a metrics record")
        _need(value["node"] == rank and not isinstance(value["node"], bool), f"node is not {rank}")
        _need(_number(value["tokens_per_s"]) and _number(value["tflops_per_s"]), "figures are not numbers")
        _need(value["all_reduce_ms"] is None or _number(value["all_reduce_ms"]), "all_reduce_ms is not a number")
        _need(isinstance(value["busy"], dict) and all(isinstance(k, str) and _number(v)
                                                      for k, v in value["busy"].items()), "busy is not numbers")
    return check


def plain_name(name: Any, allowed: Collection[str] | re.Pattern) -> str:
    """`name` if it is a plain file name of the expected set (a collection, or a pattern it must match), as
    `gpuctl pull` checks names: no separator, no `..`, not absolute, no NUL or control character."""
    _need(isinstance(name, str), "a name is not a string")
    _need(name not in ("", ".", "..") and "/" not in name and "\\" not in name and
          not any(ord(c) < 32 or ord(c) == 127 for c in name), f"{name[:80]!r} is not a plain file name")
    expected = allowed.fullmatch(name) if isinstance(allowed, re.Pattern) else name in allowed
    _need(bool(expected), f"{name[:80]!r} is not a name expected here")
    return name


def check_listing(files: Collection[str]) -> Callable[[Any], None]:
    """Nodes.share_checkpoint's listing: None, or {"name": a step_NNNNNNNN directory, "files": [[name, size]]}
    of distinct names of `files`, each size a non-negative integer."""
    def check(value: Any) -> None:
        if value is None:
            return
        _need(isinstance(value, dict) and set(value) == {"name", "files"}, "not a checkpoint listing")
        plain_name(value["name"], _STEP_DIR)
        _need(isinstance(value["files"], list), "files is not a list")
        seen = set()
        for entry in value["files"]:
            _need(isinstance(entry, list) and len(entry) == 2, "a file entry is not [name, size]")
            name, size = plain_name(entry[0], files), entry[1]
            _need(isinstance(size, int) and not isinstance(size, bool) and size >= 0, f"{name}'s size is not a size")
            _need(name not in seen, f"{name} is listed twice")
            seen.add(name)
    return check

