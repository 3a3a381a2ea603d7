"""python -m training.regenerate --config PRESET|PATH [--set KEY=VALUE]... (training/regenerate/run.py)."""

from training.entry import run_entry_point
from training.regenerate.run import main

run_entry_point(main)  # after a second signal the generation threads are still running: see end_process
