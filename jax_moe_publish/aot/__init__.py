"""Ahead-of-time compilation of the kernels: cubins, sidecars, the disk cache and the CLI."""
