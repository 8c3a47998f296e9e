"""The op's memory outside XLA, through the CUDA driver API; nothing here imports JAX.

``driver`` (driver calls and primary contexts), ``vmm`` (a mapped VMM allocation),
``group`` (one TP group's mailboxes), ``sharing`` (an allocation between processes),
``process_group`` (bounded collective steps between processes) and ``cross_process``
(a mailbox whose group spans processes).
"""
