"""The stand-in Proxmox host (ARCHITECTURE §4): real sshd, stand-in pct and nvidia-smi, a fake trainer."""

from tests.sandbox.host import ALIAS, DEFAULT_GPUS, StandInHost

__all__ = ["ALIAS", "DEFAULT_GPUS", "StandInHost"]
