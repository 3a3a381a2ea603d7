"""Toy pipeline stages for the pipeline tests: a frozen linear "target" and a small MLP "drafter".

Also a command line (`python tests/training/pipeline_toys.py ...`) that runs the pipeline the way the
trainer's entry point does (its StopRequest polled by the pipeline), so tests can check exit codes and signal
handling in a real process.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from training.entry import run_entry_point
from training.pipeline import Pipeline, PipelineConfig, PipelineError
from training.trainer import StopRequest

IN, FEATURES, OUT = 6, 12, 3


class ToyFailure(RuntimeError):
    pass


class EventLog:
    """What happened, in order, across threads:
    ("features", n), ("loss", replica, n), ("step", replica, k)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.events: list[tuple] = []

    def add(self, *event) -> None:
        with self._lock:
            self.events.append(event)


def make_batches(count: int, seed: int = 0, rows: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"n": n, "x": torch.randn(rows, IN, generator=gen), "y": torch.randn(rows, OUT, generator=gen)}
            for n in range(count)]


class ToyTarget:
    def __init__(self, device: torch.device, delay_s: float = 0.0, fail_at: int | None = None,
                 log: EventLog | None = None):
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.randn(IN, FEATURES, generator=gen).to(device)
        self.device, self.delay_s, self.fail_at, self.log = device, delay_s, fail_at, log

    def features(self, batch: dict) -> torch.Tensor:
        if batch["n"] == self.fail_at:
            raise ToyFailure(f"target failed on micro-batch {batch['n']}")
        time.sleep(self.delay_s)
        if self.log:
            self.log.add("features", batch["n"])
        return torch.tanh(batch["x"].to(self.device) @ self.weight)


class ToyDrafter:
    def __init__(self, device: torch.device, delay_s: float = 0.0, fail_at: int | None = None,
                 log: EventLog | None = None, replica: int = 0, block: threading.Event | None = None):
        # Seeded from a private generator: threads building replicas at once must not share the global RNG.
        gen = torch.Generator().manual_seed(0)
        self.model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, OUT))
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        self.model.to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.delay_s, self.fail_at, self.log, self.replica, self.block = delay_s, fail_at, log, replica, block
        self.steps = 0

    def trainable_parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def loss(self, features: torch.Tensor, batch: dict) -> torch.Tensor:
        if batch["n"] == self.fail_at:
            raise ToyFailure(f"drafter failed on micro-batch {batch['n']}")
        if self.block is not None:
            self.block.wait()
        time.sleep(self.delay_s)
        if self.log:
            self.log.add("loss", self.replica, batch["n"])
        error = self.model(features) - batch["y"]
        return error.pow(2).mean(), {"mae": error.abs().mean()}

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.steps += 1
        if self.log:
            self.log.add("step", self.replica, self.steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", type=int, default=2)
    parser.add_argument("--drafters", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--drafter-delay", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--checkpoint", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    per_step = 4
    cpu = torch.device("cpu")
    config = PipelineConfig([cpu] * args.targets, [cpu] * args.drafters, micro_batches_per_step=per_step)
    targets = [ToyTarget(cpu) for _ in range(args.targets)]
    drafters = [ToyDrafter(cpu, args.drafter_delay, args.fail_at, replica=i) for i in range(args.drafters)]

    def on_step(report):
        print(f"step {report.step} loss {report.loss:.4f}", flush=True)

    pipeline = Pipeline(
        config,
        targets,
        drafters,
        make_batches(args.steps * per_step),
        start_step=0,
        max_steps=args.steps,
        on_step=on_step,
    )
    try:
        with StopRequest() as stop:
            result = pipeline.run(stop=stop.reason)
    except PipelineError as error:
        print(error.traceback_text, file=sys.stderr)
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 130 if isinstance(error.error, KeyboardInterrupt) else 1
    args.checkpoint.write_text(json.dumps({"steps_done": result.steps_done, "stopped": result.stopped,
                                                "signal": stop.signal}))
    print(f"saved checkpoint at step {result.steps_done}", flush=True)
    return 0


if __name__ == "__main__":
    run_entry_point(main)  # ended as the trainer is (training/entry.py says why)
