"""The kernels a benchmark's cases need: built where CuTe DSL is, and found before any timing
where the GPUs are."""

from __future__ import annotations

import time


def print_build_commands(configs, one_process):
    """Print one ``python -m jax_moe_publish.aot build`` command per config: a shell script,
    headed by ``one_process``, the command that builds them all in one process."""
    from jax_moe_publish.aot.store import build_command

    print(f"# {len(configs)} kernel sets; or in one process: {one_process}")
    for config in configs:
        print(build_command(config))


def build_kernels(configs, directory):
    """Compile ``configs`` into ``directory`` (needs CuTe DSL), skipping those built from these sources."""
    from jax_moe_publish.aot.artifact import KernelArtifact
    from jax_moe_publish.aot.compile import compile_config

    for index, config in enumerate(configs, 1):
        existing = KernelArtifact.load(directory, config.key)
        if existing is not None and existing.is_current:
            print(f"[{index}/{len(configs)}] {config.key}  already built", flush=True)
            continue
        start = time.perf_counter()
        compile_config(config).save(directory)
        print(f"[{index}/{len(configs)}] {config.key}  {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{len(configs)} kernel sets in {directory}; point $JAX_MOE_PUBLISH_KERNEL_DIR at it")


def check_kernels(configs, build_hint):
    """Find every kernel before any timing, so that a missing cubin stops the run at once, not hours in.

    ``build_hint`` is the command that builds them all into a folder DIR."""
    from jax_moe_publish.aot.store import MissingKernelError, default_store

    missing = []
    for config in configs:
        try:
            default_store().get(config)
        except MissingKernelError:
            missing.append(config.key)
    if missing:
        named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise SystemExit(
            f"{len(missing)} of {len(configs)} kernels missing ({named}). Where CuTe "
            f"DSL is, run: {build_hint}\n"
            f"and point $JAX_MOE_PUBLISH_KERNEL_DIR at DIR here."
        )
