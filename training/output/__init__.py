"""What a run writes: its directory (`run_home.py`), its checkpoints (`checkpoint.py`), its metrics lines
(`metrics.py`, what gpuctl status reads) and the reporters ML users look at (`reporters.py`)."""
