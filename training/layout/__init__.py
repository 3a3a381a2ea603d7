"""Where a run computes: the devices it asks for and its dtype (`devices.py`), the roles of each device and the
model `topology = "auto"` chooses a layout with (`roles.py`, `python -m training.layout`), counted FLOPs
(`flops.py`)."""
