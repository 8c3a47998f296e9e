"""What a traced program holds: its equations and those of the jaxprs inside it (a shard_map's,
a custom_vjp's, a scan's), for tests that check which primitives a call lowers to."""

from __future__ import annotations

import jax


def equations(jaxpr, primitive: str | None = None) -> list:
    """The equations of ``jaxpr``, then those of each jaxpr inside it, in order; only those of
    ``primitive`` where it is given."""
    found = [eqn for eqn in jaxpr.eqns if primitive is None or eqn.primitive.name == primitive]
    return found + [eqn for sub in jax.extend.core.subjaxprs(jaxpr) for eqn in equations(sub, primitive)]
