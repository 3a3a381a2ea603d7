"""Checkpoints under <output_dir>/checkpoints/step_NNNNNNNN/, written atomically.

Each holds the drafter's trainable weights (drafter.safetensors, with config.json describing the drafter) and
everything a resumed run needs to continue exactly (state.pt: step, optimizer, scheduler, RNG states, data
position). A checkpoint is written into a temporary directory, fsynced, then renamed into place, so a crash or a
kill never leaves a half-written one where `latest_checkpoint` would find it. `keep` deletes old checkpoints only
after that rename. One that cannot be written (disk full, read-only, over quota) removes its temporary directory
and raises CheckpointWriteError: every earlier checkpoint is left as it was. What a save killed mid-write left
(kill -9 during the SIGTERM checkpoint: `gpuctl kill` escalates after its grace) is cleared at the run's start
and before each save (`recover_checkpoints`): its temporary directory removed, and its `.stale-` copy of a step
put back when the step's directory is missing (killed between the two renames), else removed.

The drafter's config records everything the served format needs (mask_token_id, num_target_layers, the target's
RoPE parameters), so `python -m training.export` needs nothing but the checkpoint. Checkpoints from before the
served convention (a learned mask vector instead of the `<|MASK|>` token) are refused, for resuming and export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from training.config import ConfigError
from training.durable import abandoned, fsync_path, writer_tag
from training.model.drafter import Drafter, DrafterConfig

STEP_DIR = re.compile(r"^step_(\d{8})$")
FILES = ("drafter.safetensors", "config.json", "state.pt")
LEARNED_MASK = "mask_embedding"  # the pre-convention drafter's learned mask vector


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; nothing of it is left, the earlier ones are intact. One-line message."""

    def __init__(self, path: Path, cause: OSError):
        name = errno.errorcode.get(cause.errno, "") if cause.errno else ""
        why = f"{cause.strerror} ({name})" if cause.strerror and name else str(cause)
        super().__init__(f"cannot write the checkpoint {path}: {why}; the earlier checkpoints are intact")
        self.path, self.cause = path, cause


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir).expanduser() / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / "state.pt").is_file())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def recover_checkpoints(output_dir: str | Path) -> None:
    """Clear what saves of this host killed mid-write left under the checkpoints directory (see above)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return
    for path in abandoned(root, ".tmp-"):
        shutil.rmtree(path, ignore_errors=True)
    for path in abandoned(root, ".stale-"):
        final = root / path.name.rsplit("-", 1)[-1]  # .stale-HOST-PID-step_NNNNNNNN
        if STEP_DIR.fullmatch(final.name) and not final.exists():
            os.replace(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _KeepWriteError:
    """A file for torch.save that keeps the OSError of a failed write: torch reports it as a RuntimeError
    ("unexpected pos"), which loses the cause (ENOSPC, EDQUOT, ...)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str):  # flush, seek, tell: the file's own
        return getattr(self.file, name)


def _save_state(state: dict, path: Path) -> None:
    with open(path, "wb") as file:
        writer = _KeepWriteError(file)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None


def _save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file(weights, path)
    except SafetensorError as err:  # its I/O errors come as text: "... No space left on device (os error 28)"
        found = re.search(r"\(os error (\d+)\)", str(err))
        if found is None:
            raise
        raise OSError(int(found[1]), os.strerror(int(found[1])), str(path)) from err


def save_checkpoint(output_dir: str | Path, step: int, drafter: Drafter, optimizer: torch.optim.Optimizer,
                    scheduler, data_state: dict, config: dict, keep: int, run: dict | None = None) -> Path:
    """Write step's checkpoint atomically (its config.json records `run`, the run that wrote it: {"id", "home"},
    run_home.run_record), then keep only the newest `keep` checkpoints (deleted only once the
    new one is complete: written, fsynced and renamed into place). Raises CheckpointWriteError, leaving nothing
    of the new checkpoint and every earlier one as it was, when it cannot be written."""
    root = checkpoints_dir(output_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{writer_tag()}-{final.name}"
    stale = root / f".stale-{writer_tag()}-{final.name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        recover_checkpoints(output_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        weights = {name: t.detach().float().cpu().contiguous() for name, t in drafter.state_dict().items()}
        _save_weights(weights, tmp / "drafter.safetensors")
        (tmp / "config.json").write_text(json.dumps({"drafter": drafter.config.to_dict(), "train": config,
                                                                "run": run}, indent=2))
        _save_state({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "rng": rng_state(), "data": data_state}, tmp / "state.pt")
        for file in tmp.iterdir():
            fsync_path(file)
        fsync_path(tmp)
        if final.exists():  # the same step written again (a resumed run): the new one replaces it
            os.replace(final, stale)
        os.replace(tmp, final)
        fsync_path(root)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale.exists() and not final.exists():
            with contextlib.suppress(OSError):
                os.replace(stale, final)
        raise CheckpointWriteError(final, err) from err
    shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def check_checkpoint(path: Path) -> DrafterConfig:
    """A complete checkpoint in the served convention: its drafter config, or a one-line ConfigError (missing
    file, unreadable config or weights, a learned mask vector, a config without the served format's fields)."""
    for name in FILES:
        if not (path / name).is_file():
            raise ConfigError(f"{path} is not a complete checkpoint (no {name})")
    try:
        with safe_open(path / "drafter.safetensors", "pt") as weights:
            names = set(weights.keys())
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"{path / 'drafter.safetensors'} is unreadable: {err}") from None
    if LEARNED_MASK in names:
        raise ConfigError(f"{path} holds a learned mask vector ({LEARNED_MASK}), which no engine can serve: it "
                          "predates the <|MASK|> token convention; train a fresh run")
    try:
        fields = json.loads((path / "config.json").read_text())["drafter"]
        if not isinstance(fields, dict):
            raise TypeError("'drafter' is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path / 'config.json'} holds no drafter config ({type(err).__name__}: {err})") from None
    missing = [f.name for f in dataclasses.fields(DrafterConfig)
               if f.name not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{path} predates the served format (its drafter config has no {', '.join(missing)}); "
                          "train a fresh run")
    try:
        return DrafterConfig(**fields)
    except TypeError as err:
        raise ConfigError(f"{path / 'config.json'}: not this trainer's drafter config ({err})") from None


def load_checkpoint(path: Path, drafter: Drafter, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG; returns {"step", "data"}."""
    check_checkpoint(path)
    device = next(drafter.parameters()).device
    drafter.load_state_dict(load_file(path / "drafter.safetensors", device=str(device)))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return {"step": state["step"], "data": state["data"]}


def checkpoint_run(path: Path) -> dict:
    """The run that wrote a checkpoint, {"id", "home"} (each None when it does not say: an older checkpoint)."""
    try:
        run = json.loads((path / "config.json").read_text()).get("run")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        run = None
    run = run if isinstance(run, dict) else {}
    return {"id": run.get("id"), "home": run.get("home")}


def checkpoint_train_config(path: Path) -> dict:
    """The training config a checkpoint was written with ({} when it holds none)."""
    try:
        train = json.loads((path / "config.json").read_text()).get("train")
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return train if isinstance(train, dict) else {}
