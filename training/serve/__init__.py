"""The drafter as serving sees it: the served format written (`export.py`, `python -m training.export`) and read
back to start a run from (`warm_start.py`); acceptance length tau, simulated during training (`evaluate.py`) and
measured with the reference loop and the real target (`acceptance.py`, `python -m training.acceptance`)."""
