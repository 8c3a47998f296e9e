"""jax-moe-publish: MoE finalize fused with the tensor-parallel reduction, for JAX on NVIDIA GPUs.

One custom call computes each rank's MoE finalize (top-k weighted sum of the
routed expert rows times the routing scale, plus the shared expert) and sums it
over the TP group through Lamport mailboxes that peers write over NVLink.
"""

from jax_moe_publish import reference
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.mailbox import Mailbox, MailboxStatusError
from jax_moe_publish.memory.process_group import ProcessGroupError
from jax_moe_publish.op import moe_finalize_publish, sharded_moe_finalize_publish

__all__ = [
    "KernelConfig",
    "Mailbox",
    "MailboxStatusError",
    "ProcessGroupError",
    "moe_finalize_publish",
    "reference",
    "sharded_moe_finalize_publish",
]
__version__ = "0.1.0"
