"""The compile discipline (ARCHITECTURE §6), in one place: every compiled function is warmed for each key it will
see, proven, then sealed. The shared flex_attention (`flex.py`), the compiled stages beside it (`stages.py`:
the target's decoder layers, the drafter's fusion layer and layer halves), and one run's stages, built with
the world and warmed before any pipeline thread starts (`run.py`, compile = "all")."""
