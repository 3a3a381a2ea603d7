"""Regeneration: chat data made by the target itself (`python -m training.regenerate`; the run: `run.py`), its
replies generated turn by turn (`generation.py`, with a static KV cache and CUDA graphs: `static_decode.py`),
and its records in and out (`records.py`)."""
