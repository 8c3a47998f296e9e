"""The ops under ``jax.vmap``: a batch becomes one call whose tokens are the whole batch's, on
every path, so that the kernels' FFI call never sees a batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe_publish import protocol, reference
from jax_moe_publish.mailbox import Mailbox


def folding_vmap_batches(mailbox: Mailbox, publish):
    """``publish`` (of the seven array arguments) under ``jax.vmap``: one call whose tokens are
    the whole batch's (`_fold_batch`), on every path, so the kernels' FFI call never sees a
    batch."""

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return publish(*arrays)

    @call.def_vmap
    def fold(batch, batched, *arrays):
        folded, unfold = fold_batch(mailbox, batch, batched, *arrays)
        out = unfold(call(*folded))
        return out, jax.tree.map(lambda _: True, out)

    return call


def fold_batch(mailbox, batch, batched, routed_output, expert_weights, permuted_indices, shared_output,
                residual, norm_weight, out_scale):
    """A jax.vmap batch of ``batch`` calls as the arguments of one call, and the function that
    splits that call's result into the batch's results.

    Batch element b's tokens follow element b - 1's. With a reduce_scatter mailbox each
    element's m tokens are padded to a multiple of tp with tokens that read nothing, so that
    rank r's rows of every element stay in order (row i: token ``i * tp + r``); with the
    epilogue the rows of padding tokens are zeroed, as the rows of no token are. Batched
    routed rows are stacked and each element's valid indices moved to its block."""
    if batch == 0:
        raise ValueError("jax.vmap over an empty batch: expected at least one batch element")
    for name, is_batched, what in (("norm_weight", batched[5], "one norm weight"),
                                   ("out_scale", batched[6], "one FP8 scale")):
        if is_batched:
            raise ValueError(f"{name}: under jax.vmap it differs between batch elements, but one call takes "
                             f"{what}; expected the same {name} for the whole batch (in_axes=None for it)")
    tp, m, hidden = mailbox.tp, expert_weights.shape[-2], mailbox.hidden
    scatter = mailbox.result == "reduce_scatter"
    tokens = protocol.owned_rows(m, tp) * tp if scatter else m
    if batch * tokens > mailbox.capacity_m:
        padded = f", padded to a multiple of tp={tp}" if tokens != m else ""
        raise ValueError(
            f"jax.vmap over a batch of {batch}: one call takes the batch's tokens, {batch} x {tokens} "
            f"(m={m}{padded}) = {batch * tokens}, but the mailbox holds capacity_m={mailbox.capacity_m}; "
            f"expected a Mailbox with capacity_m >= {batch * tokens}, or a smaller batch"
        )

    def per_element(x, is_batched):
        return x if is_batched else jnp.broadcast_to(x, (batch, *x.shape))

    def as_tokens(x, fill):  # [batch, m, ...] -> [batch * tokens, ...]
        x = jnp.pad(x, [(0, 0), (0, tokens - m)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(batch * tokens, *x.shape[2:])

    routed_batched, weights_batched, indices_batched, shared_batched, residual_batched, _, _ = batched
    indices = per_element(permuted_indices, indices_batched)
    if routed_batched:
        num_rows = routed_output.shape[1]
        if batch * num_rows >= 2**31:
            raise ValueError(f"jax.vmap over a batch of {batch} with routed_output batched: one call takes "
                             f"{batch} x {num_rows} = {batch * num_rows} routed rows; expected fewer than 2**31")
        valid = (indices >= 0) & (indices < num_rows)
        block = (jnp.arange(batch, dtype=jnp.int32) * num_rows)[:, None, None]
        indices = jnp.where(valid, indices + block, -1)
        routed_output = routed_output.reshape(batch * num_rows, hidden)
    folded = (
        routed_output,
        as_tokens(per_element(expert_weights, weights_batched), 0),
        as_tokens(indices, -1),
        None if shared_output is None else as_tokens(per_element(shared_output, shared_batched), 0),
        None if residual is None else per_element(residual, residual_batched).reshape(-1, hidden),
        norm_weight,
        out_scale,
    )

    def unfold(out):  # every result has a row per token (an FP8 out's scales, hidden / 128 columns)
        out = jax.tree.map(lambda x: x.reshape(batch, -1, x.shape[-1]), out)
        if residual is None or tokens == m:
            return out
        has_token = reference.rows_with_tokens(protocol.owned_rows(m, tp), m, mailbox.axis_name)[None]
        return jax.tree.map(lambda x: jnp.where(has_token, x, jnp.zeros_like(x)), out)

    return folded, unfold


def folding_expert_batches(experts_for):
    """The experts op, ``experts_for(m)(x, expert_ids, gate, up, down)`` for a call of m tokens,
    under ``jax.vmap``: one call whose tokens are the whole batch's, element b's after element
    b - 1's, so the kernels' FFI call (and ragged_dot) never sees a batch, and its route is
    that of a call of ``batch * m`` tokens. The weights must be the same for the whole batch;
    each result's rows are per token (``[m * rows per token, ...]``)."""

    @jax.custom_batching.custom_vmap
    def call(x, expert_ids, gate, up, down):
        return experts_for(expert_ids.shape[0])(x, expert_ids, gate, up, down)

    @call.def_vmap
    def fold(batch, batched, x, expert_ids, gate, up, down):
        if batch == 0:
            raise ValueError("jax.vmap over an empty batch: expected at least one batch element")
        for name, is_batched in zip(("gate_up", "gate_up", "down"), batched[2:]):
            if jax.tree.leaves(is_batched) and any(jax.tree.leaves(is_batched)):
                raise ValueError(f"{name}: under jax.vmap it differs between batch elements, but one call of the "
                                 "experts op reads one set of weights; expected the same weights for the whole "
                                 "batch (in_axes=None for them)")
        m = expert_ids.shape[-2]

        def tokens(value, is_batched):  # [batch, m, ...] -> [batch * m, ...]
            value = value if is_batched else jnp.broadcast_to(value, (batch, *value.shape))
            return value.reshape(batch * m, *value.shape[2:])

        # x may be a BlockScaled: its values and scales fold alike.
        out = call(jax.tree.map(tokens, x, batched[0]), tokens(expert_ids, batched[1]), gate, up, down)
        return jax.tree.map(lambda rows: rows.reshape(batch, -1, rows.shape[-1]), out), jax.tree.map(
            lambda _: True, out)

    return call
