"""The frozen target the drafter learns from (`frozen.py`: loaded, run for its features, the mask token; a run's
replicas of it: `load.py`) and the worlds a preset builds around one: the tiny random one for tests (`tiny.py`),
the random 8B-shaped one (`random_world.py`), a real one made from a GGUF file (`from_gguf.py`); the target's RoPE
(`rope.py`)."""
