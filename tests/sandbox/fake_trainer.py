"""A stand-in trainer interpreter for fast CLI tests: `gpuctl launch --python fake-trainer ...`.

Called as `fake-trainer -m training.train --config X [--set K=V]...` (what run.sh runs). It prints its argv
as the first log line (so tests can check that values arrived verbatim), then one line and one metrics record
per step. Like the real trainer it says where its output goes ({"output_dir": ABSOLUTE} into $GPUCTL_RUN_INFO;
`--set output_dir=DIR`, default runs/fake under its working directory), writes checkpoints
(<output_dir>/checkpoints/step_NNNNNNNN/ with drafter.safetensors, config.json and state.pt, each built under a
temporary name and renamed) at the end, on a SIGTERM stop and every fake.save_every steps, and exports itself
into <output_dir>/export/ when it ends with exit 0. Behaviour comes from `--set fake.KEY=VALUE`:
  fake.steps=N (5)       fake.step_s=SECONDS (0.05)   fake.exit=CODE (0)
  fake.child=1           spawn a child (and it a grandchild) that stay in the run's process group
  fake.ignore_term=1     ignore SIGTERM (so `gpuctl kill` must escalate to SIGKILL)
  fake.term_exit=CODE    on SIGTERM print "got SIGTERM #N" (N counts them), finish the step, checkpoint, exit CODE
  fake.save_every=N (0)  a checkpoint every N steps too
  fake.weights_bytes=N (4096), fake.state_bytes=N (8192): sizes of drafter.safetensors (random bytes; the
                         export's model.safetensors is the same bytes) and state.pt
  fake.export=0          no export at the end
  fake.require=PATH      fail (exit 3, before any step) unless PATH exists (`launch --retry` tests: the data
                         file that appears only later); the trainer's --resume is accepted and ignored
  fake.exit_seq=C1,C2,.. the Kth start in this output_dir exits CK before any step (the last one repeated)
  fake.hold=PATH         step on past fake.steps until PATH exists, then finish: a run that ends when a test says
  fake.env=K1,K2,..      print `env: {JSON}` second: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and K1, K2..
                         as this process got them (null where unset): a multi-node launch's contract
  fake.fail_rank=K       the node with RANK=K fails after its first step: `error: fake failure on node K`, exit 1
  fake.say=HEX           the bytes HEX (hex, so any byte arrives through argv) as the log's last line, however
                         the trainer ends (escape sequences: what the container prints reaches gpuctl's terminal)

Called as `fake-trainer -m training.export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype D] [--force]` it stands in
for the real exporter's interface: the newest complete checkpoint of a run's output_dir (or the checkpoint
given) into OUT_DIR (config.json naming the checkpoint, model.safetensors = its drafter.safetensors), built
beside OUT_DIR and renamed into place; a non-empty OUT_DIR without --force, or nothing to export: one line, 2;
a failed write: one line, 1.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

STEP_DIR = re.compile(r"^step_\d{8}$")
CHECKPOINT_FILES = ("drafter.safetensors", "config.json", "state.pt")


def options(argv: list[str]) -> dict[str, str]:
    found = {}
    for flag, value in itertools.pairwise(argv):
        if flag == "--set" and value.startswith("fake.") and "=" in value:
            key, val = value[len("fake."):].split("=", 1)
            found[key] = val
    return found


def output_dir(argv: list[str]) -> Path:
    found = "runs/fake"
    for flag, value in itertools.pairwise(argv):
        if flag == "--set" and value.startswith("output_dir="):
            found = value.split("=", 1)[1].strip().strip("\"'")
    return Path(found).expanduser().resolve()


def build_dir(final: Path, files: dict[str, bytes]) -> None:
    """A directory of files, built under a temporary name and renamed into place (an old one replaced)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)


def save_checkpoint(out: Path, step: int, opts: dict[str, str]) -> Path:
    final = out / "checkpoints" / f"step_{step:08d}"
    build_dir(final, {"drafter.safetensors": os.urandom(int(opts.get("weights_bytes", 4096))),
                      "config.json": json.dumps({"step": step, "run": written_by()}).encode(),
                      "state.pt": os.urandom(int(opts.get("state_bytes", 8192)))})
    return final


def written_by() -> dict[str, str | None]:
    """What the real trainer records of the run that wrote a checkpoint: gpuctl's run id and home."""
    return {"id": os.environ.get("GPUCTL_RUN_ID"), "home": os.environ.get("GPUCTL_RUN_HOME")}


def newest_checkpoint(source: Path) -> Path | None:
    if STEP_DIR.match(source.name) or (source / "drafter.safetensors").is_file():
        return source
    complete = [p for p in sorted((source / "checkpoints").glob("step_*"))
                if STEP_DIR.match(p.name) and all((p / f).is_file() for f in CHECKPOINT_FILES)]
    return complete[-1] if complete else None


def export(source: Path, out: Path) -> None:
    checkpoint = newest_checkpoint(source)
    run = json.loads((checkpoint / "config.json").read_text()).get("run") or {}  # as the trainer: the checkpoint's
    config = {"architectures": ["DFlashDraftModel"], "checkpoint": checkpoint.name,
              "gpuctl": {"run": run.get("id"), "home": run.get("home")}}
    build_dir(out, {"config.json": json.dumps(config).encode(),
                    "model.safetensors": (checkpoint / "drafter.safetensors").read_bytes()})


def export_main(argv: list[str]) -> int:
    force = "--force" in argv
    args = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--dtype")]
    if len(args) != 2:
        print("error: usage: -m training.export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype D] [--force]", file=sys.stderr)
        return 2
    source, out = Path(args[0]), Path(args[1])
    if not source.is_dir() or newest_checkpoint(source) is None:
        print(f"error: no complete checkpoint in {source}", file=sys.stderr)
        return 2
    if out.is_dir() and any(out.iterdir()) and not force:
        print(f"error: {out} is not empty (pass --force to replace it)", file=sys.stderr)
        return 2
    try:
        export(source, out)
    except OSError as err:
        print(f"error: writing {out}: {err}", file=sys.stderr)
        return 1
    print(f"exported {newest_checkpoint(source)} to {out}")
    return 0


def announce(out: Path) -> None:
    path = os.environ.get("GPUCTL_RUN_INFO")
    if path:
        Path(path + ".tmp").write_text(json.dumps({"output_dir": str(out)}, ensure_ascii=False) + "\n")
        os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    if argv[:2] == ["-m", "training.export"]:
        return export_main(argv[2:])
    print("argv: " + json.dumps(argv), flush=True)
    opts = options(argv)
    if "env" in opts:
        keys = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *filter(None, opts["env"].split(","))]
        print("env: " + json.dumps({key: os.environ.get(key) for key in keys}), flush=True)
    fails = opts.get("fail_rank") is not None and os.environ.get("RANK") == opts["fail_rank"]
    steps, step_s, code = int(opts.get("steps", 5)), float(opts.get("step_s", 0.05)), int(opts.get("exit", 0))
    save_every = int(opts.get("save_every", 0))
    out = output_dir(argv)
    announce(out)
    if "exit_seq" in opts:
        counter = out / ".fake_starts"
        counter.parent.mkdir(parents=True, exist_ok=True)
        starts = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(starts))
        codes = [int(c) for c in opts["exit_seq"].split(",")]
        print(f"start {starts}: exit {codes[min(starts, len(codes)) - 1]}", flush=True)
        return codes[min(starts, len(codes)) - 1]
    if "require" in opts and not Path(opts["require"]).exists():
        print(f"error: {opts['require']} not found", flush=True)
        return 3
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
    done = 0
    hold = opts.get("hold")
    for step in itertools.count(1):
        if step > steps and not (hold and not Path(hold).exists()):
            break
        time.sleep(step_s)
        if terms:
            if done:
                save_checkpoint(out, done, opts)
            print("stopping at a step boundary", flush=True)
            return int(opts["term_exit"])
        loss = 10.0 / step
        print(f"step {step}/{steps} loss {loss:.4f}", flush=True)
        if metrics:
            with open(metrics, "a") as f:
                f.write(json.dumps({"step": step, "total_steps": steps, "loss": loss, "lr": 1e-3,
                                    "tokens_per_s": 1000.0, "time": time.time() - start}) + "\n")
        done = step
        if fails:
            print(f"error: fake failure on node {opts['fail_rank']}", flush=True)
            return 1
        if (save_every and step % save_every == 0) or step == steps:
            save_checkpoint(out, step, opts)
    if code == 0 and opts.get("export") != "0" and done:
        export(out, out / "export")
    print(f"done, exit {code}", flush=True)
    return code


def say_last(argv: list[str]) -> None:
    said = options(argv).get("say")
    if said is not None and argv[:2] != ["-m", "training.export"]:
        sys.stdout.flush()
        sys.stdout.buffer.write(bytes.fromhex(said) + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    say_last(sys.argv[1:])
    sys.exit(code)
