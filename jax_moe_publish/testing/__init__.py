"""Tooling for the tests, examples and benchmarks; nothing of the op imports it.

``local_processes`` starts and joins the processes of one machine under
``jax.distributed``; ``gpu_matrix`` lists the kernel configs the GPU tests run (the
``tests`` preset).
"""
