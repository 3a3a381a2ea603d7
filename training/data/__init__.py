"""The training data: a run's batches and held-out set (`load.py`), chat conversations to fixed-shape batches
(`chat.py`), tokenised once and cached on disk (`tokenized.py`), and prompts from a real source for regeneration
(`prompts.py`, `python -m training.prompts`)."""
