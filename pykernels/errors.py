"""Exceptions of pykernels, and the checks every op uses so errors read the same everywhere:
"pykernels.<op>: expected <what> for '<arg>', got <what came>"."""
from __future__ import annotations

from typing import Optional

import torch


class TableFullError(RuntimeError):
    """A non-growable hash table ran out of room. `not_inserted` says how many keys were left out;
    every key that was inserted stays findable."""

    def __init__(self, op: str, not_inserted: int, capacity: int, max_load_factor: Optional[float] = None):
        self.not_inserted = int(not_inserted)
        self.capacity = int(capacity)
        # capacity counts slots, of which max_load_factor may fill: say so (a HashMap(1000) holds 900
        # keys at the default 0.9, which surprised a drop-in user; audit)
        limit = "" if max_load_factor is None else (
            f", max_load_factor={max_load_factor:g}: at most {int(max_load_factor * capacity)} keys")
        super().__init__(f"pykernels.{op}: table is full (capacity {capacity} slots{limit}, growable=False): "
                         f"{not_inserted} key(s) were not inserted; make the table with capacity >= keys / "
                         f"max_load_factor, or growable=True")


def check_dtype(op: str, arg: str, tensor: torch.Tensor, allowed) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"pykernels.{op}: expected '{arg}' of dtype {names}, got "
                        f"{str(tensor.dtype).replace('torch.', '')}")


def check_ndim(op: str, arg: str, tensor: torch.Tensor, ndim) -> None:
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if tensor.dim() not in allowed:
        raise ValueError(f"pykernels.{op}: expected '{arg}' with {' or '.join(map(str, allowed))} "
                         f"dimension(s), got shape {tuple(tensor.shape)}")


def check_same_device(op: str, **tensors: torch.Tensor) -> torch.device:
    first = None
    for t in tensors.values():  # a plain loop: on every op's call path
        if t is None:
            continue
        if first is None:
            first = t.device
        elif t.device != first:
            desc = ", ".join(f"'{k}' on {v.device}" for k, v in tensors.items() if v is not None)
            raise RuntimeError(f"pykernels.{op}: expected all tensors on one device, got {desc}")
    return first
