"""Joining node 0's rendezvous: the store, every node proven to hold the run's node secret (both ways), the
sealed store over it, and this node's heartbeat started on a connection of its own (ARCHITECTURE §8)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from training.distributed.env import NodeEnv, NodeLost, Timeouts
from training.distributed.heartbeat import HEARTBEAT_LOST_S, Heartbeat
from training.distributed.secret import SealedStore, prove_joiners, prove_to_leader


class Rendezvous:
    """This node joined to node 0's store (`store`, sealed with a secret), beating (`heartbeat`)."""

    def __init__(self, env: NodeEnv, timeouts: Timeouts, on_lost: Callable[[str], None],
                 secret: bytes | None = None):
        """Join node 0's rendezvous (every node within timeouts.start_s; with `secret`, every node proves it
        holds it, both ways, before anything else: training/distributed/secret.py) and start beating."""
        self.rank, self.world_size, self.env = env.rank, env.world_size, env
        self.timeouts = timeouts
        deadline = time.monotonic() + timeouts.start_s
        try:
            raw = dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0,
                                timeout=timedelta(seconds=timeouts.start_s), wait_for_workers=secret is None)
            # With a secret (every run gpuctl starts), the store holds only sealed values once every node proved
            # it holds the secret: a stranger takes no part in the group's formation nor in the heartbeats.
            self.store, session = raw, None
            if secret is not None:
                prove = prove_joiners if env.rank == 0 else prove_to_leader
                session = prove(raw, secret, env, deadline, timeouts.start_s)
                self.store = SealedStore(raw, secret, env, session, timeouts.start_s)
            # Its own connection: the heartbeat thread never waits behind the process group's use of the store.
            beat_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False,
                                       timeout=timedelta(seconds=30), wait_for_workers=False)
            if session is not None:
                beat_store = SealedStore(beat_store, secret, env, session, timeouts.start_s)
            self.heartbeat = Heartbeat(beat_store, env.rank, env.world_size, min(HEARTBEAT_LOST_S, timeouts.step_s),
                                       on_lost)
            beat_store.wait(self.heartbeat.keys, timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except NodeLost:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several kinds here; all mean "could not join"
            raise NodeLost(self._join_failure(err)) from None
        self.heartbeat.start()


    def _join_failure(self, err: BaseException) -> str:
        where = f"{self.env.master_addr}:{self.env.master_port}"
        if self.rank == 0:
            return (f"not every node joined within {self.timeouts.start_s:.0f} s (node_start_timeout_s): this node "
                    f"listens on {where}; the others must reach it and start with WORLD_SIZE={self.world_size} "
                    f"({type(err).__name__}: {err})")
        return (f"could not join node 0 at {where} within {self.timeouts.start_s:.0f} s (node_start_timeout_s): is "
                f"it started, and is the port open between the nodes? ({type(err).__name__}: {err})")
