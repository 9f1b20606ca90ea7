"""8-bit moments of sharded params (FSDP2's DTensors): blocks per shard.

Each rank codes its own shard in blocks of ``QBLOCK`` (a block never straddles a shard), so
the block scales of a ``Shard(0)`` param are per shard: a DTensor of shape (shards, blocks
of the largest shard), one row a rank, sharded along the mesh like the param's dim 0
(``lean_scales``). Its first dim records how many shards made the codes, which is what a
load into another sharding needs to decode them (``block_index``). A ``Replicate`` param
has the scales of the whole tensor, replicated.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import torch

from .. import _distributed, ops
from ..ops import blocks


def shard_blocks(shape, shards):
    """Blocks of the largest of `shards` Shard(0) shards of a tensor of `shape` (torch.chunk's
    cut: ceil(rows / shards) rows): the row length of its per-shard scales."""
    rows = shape[0] if len(shape) else 0
    if not rows:
        return 0
    shard_rows = -(-rows // shards)
    return blocks(shard_rows * (torch.Size(shape).numel() // rows))


def scales_fit(scales, shape):
    """Whether `scales` are those of 8-bit codes of `shape`: ceil(numel / QBLOCK) of them,
    or (shards, shard_blocks) of a Shard(0) sharding."""
    if not isinstance(scales, torch.Tensor):
        return False
    if scales.dim() == 2:
        return scales.shape[0] >= 1 and scales.shape[1] == shard_blocks(shape, scales.shape[0])
    return scales.numel() == blocks(torch.Size(shape).numel())


def block_index(shape, scales, device):
    """For each element of codes of `shape`, the index of its block's scale in
    scales.reshape(-1): blocks of the whole tensor, or of each Shard(0) shard when the
    scales are per shard (2-d)."""
    n = torch.Size(shape).numel()
    i = torch.arange(n, device=device)
    if scales.dim() != 2:
        return i // ops.QBLOCK
    shards, width = scales.shape
    per_row = n // shape[0] if n else 1
    chunk = -(-shape[0] // shards) * per_row       # elements of every shard but the last
    shard = i // chunk
    return shard * width + (i - shard * chunk) // ops.QBLOCK


def lean_scales(who, p):
    """Zero block scales of 8-bit moments for the DTensor param p: Replicate on a 1-d mesh,
    one scale a block of the whole tensor, replicated; Shard(0), a (shards, blocks) DTensor
    whose row r holds the scales of rank r's shard (the unused tail of a smaller shard's
    row stays 0). Other layouts (2-d meshes, other dims) are refused."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, zeros
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim == 1 and isinstance(placements[0], Replicate):
        return zeros(blocks(p.numel()), device_mesh=mesh, placements=[Replicate()])
    if mesh.ndim != 1 or placements != (Shard(0),) or p.dim() == 0:
        raise NotImplementedError(f"{who}: 8-bit moments of DTensor params take Shard(0) or "
                                  f"Replicate on a 1-d mesh (FSDP2's fully_shard); this param "
                                  f"is {placements} on a {mesh.ndim}-d mesh: use moments="
                                  "'bf16' or 'fp32' for it")
    shards = mesh.size()
    width = shard_blocks(p.shape, shards)
    local = torch.zeros(1, width, device=p.to_local().device)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                              shape=(shards, width), stride=(width, 1))


def local_scales(who, i, p, scales):
    """The scales of this rank's shard of p, a 1-d view of exactly its blocks."""
    if not _distributed.is_dtensor(scales) or not (scales.device_mesh is p.device_mesh
                                                   or scales.device_mesh == p.device_mesh):
        raise ValueError(f"{who}: the 8-bit scales of param {i} are not a DTensor on the "
                         "param's mesh (a checkpoint loaded without "
                         "torch.distributed.checkpoint?)")
    local = scales._local_tensor.reshape(-1)
    need = blocks(p._local_tensor.numel())
    if local.numel() < need:
        raise ValueError(f"{who}: param {i}'s shard has {need} blocks of 8-bit moments but "
                         f"its scales hold {local.numel()} (a state of another sharding)")
    return local[:need]


def saved_scales_shape(p):
    """The shape of the 8-bit scales this sharding of the DTensor param p keeps."""
    if len(p.placements) == 1 and p.placements[0].is_shard(0):
        shards = p.device_mesh.size()
        return (shards, shard_blocks(p.shape, shards))
    return (blocks(p.numel()),)
