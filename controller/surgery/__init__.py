"""milepost.surgery: transform checkpoints from the controller, with the bytes moved by the hosts.

Open checkpoints lazily, plan renames, casts, stacks, merges and averages on their trees (only
metadata is read, and a wrong plan fails at once), then ``write`` the result as an ordinary
committed checkpoint: the hosts read, compute (jitted, on their devices) and write a group of
leaves at a time, within a memory budget per host.

>>> from milepost import surgery as ms
>>> ck = ms.open("/ckpt/1000")
>>> t = ms.rename(ck.tree, {r"^params\\.(.*)": r"model.\\1", r"^opt_state\\..*": None})
>>> t = ms.cast(t, jnp.bfloat16, where=r"kernel$")
>>> ms.write("/ckpt/1000-bf16", t)
"""

from milepost.surgery._checkpoint import Checkpoint, open
from milepost.surgery._inspect import Diff, Table, diff, stats
from milepost.surgery._lazy import LazyArray
from milepost.surgery._ops import (
    average,
    cast,
    concat,
    drop,
    map,
    rename,
    select,
    split,
    stack,
    unstack,
)
from milepost.surgery._run import materialize, write, write_items

__all__ = [
    "Checkpoint",
    "Diff",
    "LazyArray",
    "Table",
    "average",
    "cast",
    "concat",
    "diff",
    "drop",
    "map",
    "materialize",
    "open",
    "rename",
    "select",
    "split",
    "stack",
    "stats",
    "unstack",
    "write",
    "write_items",
]
