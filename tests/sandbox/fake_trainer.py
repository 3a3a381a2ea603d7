"""A stand-in trainer interpreter for fast CLI tests: `gpuctl launch --python fake-trainer ...`.

Called as `fake-trainer -m training.train --config X [--set K=V]...` (what run.sh runs). It prints its argv
as the first log line (so tests can check that values arrived verbatim), then one line and one metrics record
per step. Behaviour comes from `--set fake.KEY=VALUE`:
  fake.steps=N (5)       fake.step_s=SECONDS (0.05)   fake.exit=CODE (0)
  fake.child=1           spawn a child (and it a grandchild) that stay in the run's process group
  fake.ignore_term=1     ignore SIGTERM (so `gpuctl kill` must escalate to SIGKILL)
  fake.term_exit=CODE    on SIGTERM print "got SIGTERM #N" (N counts them), finish the step, exit CODE
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time


def options(argv: list[str]) -> dict[str, str]:
    found = {}
    for flag, value in itertools.pairwise(argv):
        if flag == "--set" and value.startswith("fake.") and "=" in value:
            key, val = value[len("fake."):].split("=", 1)
            found[key] = val
    return found


def main(argv: list[str]) -> int:
    print("argv: " + json.dumps(argv), flush=True)
    opts = options(argv)
    steps, step_s, code = int(opts.get("steps", 5)), float(opts.get("step_s", 0.05)), int(opts.get("exit", 0))
    if opts.get("ignore_term") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    terms = []
    if "term_exit" in opts:
        def on_term(signum, frame):
            terms.append(signum)
            print(f"got SIGTERM #{len(terms)}", flush=True)
        signal.signal(signal.SIGTERM, on_term)
    if opts.get("child") == "1":
        # A child that itself starts a grandchild: both must die with the run.
        subprocess.Popen(["/bin/sh", "-c", "sleep 300 & exec sleep 301"])
    metrics = os.environ.get("GPUCTL_METRICS")
    start = time.time()
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if terms:
            print("stopping at a step boundary", flush=True)
            return int(opts["term_exit"])
        loss = 10.0 / step
        print(f"step {step}/{steps} loss {loss:.4f}", flush=True)
        if metrics:
            with open(metrics, "a") as f:
                f.write(json.dumps({"step": step, "total_steps": steps, "loss": loss, "lr": 1e-3,
                                    "tokens_per_s": 1000.0, "time": time.time() - start}) + "\n")
    print(f"done, exit {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
