"""gpuctl: launch, follow and control training runs inside Proxmox LXC containers over SSH."""

__version__ = "0.2.0"
