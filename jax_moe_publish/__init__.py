"""jax-moe-publish: the MoE decode layer's experts and its tensor-parallel finalize, for JAX on
NVIDIA GPUs.

`moe_experts` runs the routed experts of a decode batch, reading each active expert's weights
once. `moe_finalize_publish` computes each rank's MoE finalize (top-k weighted sum of the
routed expert rows times the routing scale, plus the shared expert) and sums it over the TP
group through Lamport mailboxes that peers write over NVLink, in one custom call.
"""

from jax_moe_publish import reference
from jax_moe_publish.block_scaled import BlockScaled
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.experts import moe_experts, prepare_experts
from jax_moe_publish.experts_config import ExpertsConfig
from jax_moe_publish.experts_layout import PreparedExperts
from jax_moe_publish.mailbox import Mailbox, MailboxStatusError
from jax_moe_publish.memory.process_group import ProcessGroupError
from jax_moe_publish.op import moe_finalize_publish, sharded_moe_finalize_publish

__all__ = [
    "BlockScaled",
    "ExpertsConfig",
    "KernelConfig",
    "Mailbox",
    "MailboxStatusError",
    "PreparedExperts",
    "ProcessGroupError",
    "moe_experts",
    "moe_finalize_publish",
    "prepare_experts",
    "reference",
    "sharded_moe_finalize_publish",
]
__version__ = "0.1.0"
