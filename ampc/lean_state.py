"""The lean training state: what ``ampc.optim.Adam``/``AdamW`` keep per parameter when
asked for less than fp32 moments and fp32 master weights, how it converts to and from
torch's AdamW state, and what the state of a model and its optimizer costs.

The code lives in ``ampc.optim`` (``_codes``: layouts and 8-bit codes; ``_shards``: 8-bit
blocks of sharded params; ``_convert``: checkpoints; ``_state_bytes``: the bytes report);
this module is its public face.
"""
from .optim._codes import (CODES, MOMENTS, decode_moments, encode_moments, has_moments,
                           layout_of, moment_keys, upgrade_codes)
from .optim._convert import to_torch_state
from .optim._lean import PRESETS
from .optim._shards import scales_fit, shard_blocks
from .optim._state_bytes import state_bytes

__all__ = ["MOMENTS", "PRESETS", "CODES", "decode_moments", "encode_moments", "layout_of",
           "has_moments", "moment_keys", "upgrade_codes", "to_torch_state", "state_bytes",
           "scales_fit", "shard_blocks"]
