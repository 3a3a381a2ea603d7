"""The DFlash drafter trainer that gpuctl stages into a container and runs."""
