"""The drafter (`drafter.py`; DFlash2: `dflash2.py`), its attention and the DFlash mask (`attention.py`,
`mask.py`), its losses (`loss.py`, `selector_loss.py`) and its half of a training step (`step.py`)."""
