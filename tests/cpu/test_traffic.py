"""`jax_moe_publish.traffic`: the byte model, by hand on small problems."""

from __future__ import annotations

import pytest

from jax_moe_publish import traffic


def test_bytes_per_rank_direct_by_hand():
    # m=3, hidden=8, top_k=1, no shared expert, float32 weights:
    # routed 3*1*8*2 = 48, indices + weights 3*1*(4+4) = 24, output 3*8*2 = 48.
    moved = traffic.bytes_per_rank(algorithm="direct", tp=1, m=3, hidden=8, top_k=1, shared_expert=False)
    assert moved == {"hbm": 120.0, "nvlink": 0.0}


def test_bytes_per_rank_oneshot_by_hand():
    # m=2, hidden=16, top_k=2, shared expert, tp=2; row = 2*16*2 = 64 bytes.
    # inputs: routed 2*2*16*2 = 128, shared 64, indices + weights 2*2*8 = 32 -> 224;
    # mailbox writes 2*64, reduce reads 2*64, output 64, re-arm 2*64 -> 448.
    moved = traffic.bytes_per_rank(algorithm="oneshot", tp=2, m=2, hidden=16, top_k=2, shared_expert=True)
    assert moved == {"hbm": 672.0, "nvlink": 64.0}


def test_bytes_per_rank_oneshot_without_own_slot_by_hand():
    # The oneshot problem, the own partial kept out of the mailbox: only the peer's slot is
    # written, read and re-armed: 672 - 3*64.
    moved = traffic.bytes_per_rank(algorithm="oneshot", tp=2, m=2, hidden=16, top_k=2, shared_expert=True,
                                   own_slot=False)
    assert moved == {"hbm": 480.0, "nvlink": 64.0}


def test_bytes_per_rank_epilogue_by_hand():
    # The oneshot problem with the residual add + RMSNorm: residual 64 and residual_out 64
    # bytes, norm weight 16*2 = 32 -> 672 + 160.
    moved = traffic.bytes_per_rank(algorithm="oneshot", tp=2, m=2, hidden=16, top_k=2, shared_expert=True,
                                   epilogue="rmsnorm")
    assert moved == {"hbm": 832.0, "nvlink": 64.0}


def test_bytes_per_rank_twoshot_by_hand():
    # The same problem in twoshot: inputs 224; contributions landing 64, read 64, re-arm 64,
    # owned output 32; gather area landing 32, read 32, output 32, re-arm 32 -> 576.
    # NVLink: half the publish (32) and the fan-out of the owned half (32).
    moved = traffic.bytes_per_rank(algorithm="twoshot", tp=2, m=2, hidden=16, top_k=2, shared_expert=True)
    assert moved == {"hbm": 576.0, "nvlink": 64.0}


def test_bytes_per_rank_twoshot_epilogue_by_hand():
    # The twoshot problem with the residual add + RMSNorm, counted per kernel (rank 0 owns
    # token 0, rank 1 token 1; each row 32 bytes):
    # publish: routed, shared, indices and weights 224; token 1's partial crosses to rank 1.
    # reduce_norm on the owner: its slots receive both ranks' partials of token 0 (64), which
    #   it reads (64) and re-arms (64); it reads token 0's residual (32) and the norm weight
    #   (16*2 = 32), writes out and residual_out of token 0 (64), and stores both into rank
    #   1's gather areas: 64 bytes over NVLink.
    # gather_norm: rank 0's gather areas receive token 1's out and residual_out (64), which
    #   it reads (64), copies into its outputs (64) and re-arms (64).
    hbm = 224 + (64 + 64 + 64) + (32 + 32 + 64) + (64 + 64 + 64 + 64)
    nvlink = 32 + 2 * 32
    moved = traffic.bytes_per_rank(algorithm="twoshot", tp=2, m=2, hidden=16, top_k=2, shared_expert=True,
                                   epilogue="rmsnorm")
    assert moved == {"hbm": hbm, "nvlink": nvlink}


def test_bytes_per_rank_bf16_weights():
    # Half the weight bytes: 3*1*(4+2) = 18 instead of 24.
    moved = traffic.bytes_per_rank(algorithm="direct", tp=1, m=3, hidden=8, top_k=1, shared_expert=False,
                                   weight_bytes=2)
    assert moved["hbm"] == 114.0


def test_bytes_per_rank_reduce_scatter_by_hand():
    # The twoshot problem without the fan-out: inputs 224; contributions landing 64, read 64,
    # re-arm 64, owned output 32 -> 448. NVLink: half the publish (32).
    moved = traffic.bytes_per_rank(algorithm="reduce_scatter", tp=2, m=2, hidden=16, top_k=2, shared_expert=True)
    assert moved == {"hbm": 448.0, "nvlink": 32.0}


def test_bytes_per_rank_reduce_scatter_epilogue_by_hand():
    # With the residual add + RMSNorm: the owned residual (32) and the norm weight (32) read,
    # residual_out of the owned row (32) written -> 448 + 96.
    moved = traffic.bytes_per_rank(algorithm="reduce_scatter", tp=2, m=2, hidden=16, top_k=2, shared_expert=True,
                                   epilogue="rmsnorm")
    assert moved == {"hbm": 544.0, "nvlink": 32.0}


@pytest.mark.parametrize("algorithm, tp, message", [
    ("allgather", 2, "algorithm='allgather'"),
    ("oneshot", 1, "tp=1"),
    ("direct", 2, "tp=2"),
])
def test_bytes_per_rank_rejects(algorithm, tp, message):
    with pytest.raises(ValueError, match=message):
        traffic.bytes_per_rank(algorithm=algorithm, tp=tp, m=1, hidden=16, top_k=1, shared_expert=False)


def test_bytes_per_rank_rejects_an_unknown_epilogue():
    with pytest.raises(ValueError, match="epilogue='layernorm'"):
        traffic.bytes_per_rank(algorithm="oneshot", tp=2, m=1, hidden=16, top_k=1, shared_expert=False,
                               epilogue="layernorm")
