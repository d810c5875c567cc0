"""The layouts the audit cuts a sequence in for a layer that takes its own shard, and puts it back from: which global
positions rank r holds of a T-token sequence, in the order it holds them.

    contiguous  one run each                          tokens r*T/W .. (r+1)*T/W - 1
    zigzag      chunks r and 2W-1-r of 2W chunks      a causal ring's work balanced (ring-flash-attention, Megatron's
                                                      context parallel, torch's `context_parallel` load balancer)
    striped     every W-th token from r               (Brandon et al. 2023, "Striped Attention")

Where W does not divide T (or 2W for zigzag) the shards are uneven, by torch.tensor_split's rule (the first get one
more): that is the input of the `sharded_lengths` check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._errors import expect

LAYOUTS = ("contiguous", "zigzag", "striped")


def shard_positions(layout: str, t: int, rank: int, world_size: int) -> Tensor:
    """(T_r,) the global positions rank `rank` holds, in its order."""
    expect(layout in LAYOUTS, f"a layout in {LAYOUTS}", f"layout={layout!r}", "pass layout='contiguous'")
    order = torch.arange(t)
    if layout == "contiguous":
        return order.tensor_split(world_size)[rank]
    if layout == "striped":
        return order[rank::world_size]
    chunks = order.tensor_split(2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def rank_of_positions(layout: str, t: int, world_size: int) -> Tensor:
    """(T,) the rank that holds each position."""
    owner = torch.empty(t, dtype=torch.long)
    for rank in range(world_size):
        owner[shard_positions(layout, t, rank, world_size)] = rank
    return owner


def ranks_order(layout: str, t: int, world_size: int) -> Tensor:
    """(T,) the positions of every rank's shard end to end, in the ranks' order: what a gather that forgets to undo
    the layout returns in position i."""
    return torch.cat([shard_positions(layout, t, r, world_size) for r in range(world_size)])


__all__ = ["LAYOUTS", "rank_of_positions", "ranks_order", "shard_positions"]
