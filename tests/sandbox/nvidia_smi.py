"""Stand-in `nvidia-smi` for a stand-in container: its GPUs are read from gpus.json beside this file.

gpus.json is a list of {"name", "utilization", "memory_used_mib", "memory_total_mib"}; tests set it through
StandInHost.set_gpus. A file `hang` beside it makes every call hang, like a wedged driver (StandInHost.hang_gpus). Supports `--query-gpu=FIELDS --format=csv[,noheader][,nounits]`, `-L` and the bare table,
whose header names the driver's version and the newest CUDA version it supports, as the real one's does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DRIVER_VERSION = "570.133.20"
CUDA_VERSION = "12.8"
FIELDS = {
    "index": lambda i, g: str(i),
    "name": lambda i, g: g["name"],
    "utilization.gpu": lambda i, g: f"{g['utilization']} %",
    "memory.used": lambda i, g: f"{g['memory_used_mib']} MiB",
    "memory.total": lambda i, g: f"{g['memory_total_mib']} MiB",
    "uuid": lambda i, g: f"GPU-00000000-0000-0000-0000-{i:012d}",
    "driver_version": lambda i, g: DRIVER_VERSION,
}
HEADERS = {"index": "index", "name": "name", "utilization.gpu": "utilization.gpu [%]",
           "memory.used": "memory.used [MiB]", "memory.total": "memory.total [MiB]", "uuid": "uuid",
           "driver_version": "driver_version"}


def load_gpus() -> list[dict]:
    path = Path(__file__).resolve().parent / "gpus.json"
    return json.loads(path.read_text()) if path.is_file() else []


def main(argv: list[str]) -> int:
    if (Path(__file__).resolve().parent / "hang").exists():  # a hung driver (StandInHost.hang_gpus)
        time.sleep(3600)
    gpus = load_gpus()
    if not gpus:
        print("No devices were found")
        return 6
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    if query is not None:
        fields = [f.strip() for f in query.split(",")]
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            print(f'Field "{unknown[0]}" is not a valid field to query.', file=sys.stderr)
            return 2
        opts = fmt.split(",")
        if "csv" not in opts:
            print('"--format" is required with --query-gpu', file=sys.stderr)
            return 2
        if "noheader" not in opts:
            print(", ".join(HEADERS[f] for f in fields))
        for i, gpu in enumerate(gpus):
            values = [FIELDS[f](i, gpu) for f in fields]
            if "nounits" in opts:
                values = [v.removesuffix(" %").removesuffix(" MiB") for v in values]
            print(", ".join(values))
        return 0
    if "-L" in argv:
        for i, gpu in enumerate(gpus):
            print(f"GPU {i}: {gpu['name']} (UUID: {FIELDS['uuid'](i, gpu)})")
        return 0
    print("+-----------------------------------------------------------------------------+")
    print(f"| NVIDIA-SMI {DRIVER_VERSION:<15} Driver Version: {DRIVER_VERSION:<13} CUDA Version: {CUDA_VERSION:<7}|")
    print("|-------------------------------+-----------------------+---------------------+")
    print("| GPU  Name                    | Memory-Usage          | GPU-Util            |")
    for i, gpu in enumerate(gpus):
        mem = f"{gpu['memory_used_mib']}MiB / {gpu['memory_total_mib']}MiB"
        print(f"| {i:<4} {gpu['name']:<23} | {mem:<21} | {gpu['utilization']:>3}%                |")
    print("+-----------------------------------------------------------------------------+")
    print("| Processes: none visible (the driver is not PID-namespace aware)             |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
