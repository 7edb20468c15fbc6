"""Exceptions of pykernels, and the checks every op uses so errors read the same everywhere:
"pykernels.<op>: expected <what> for '<arg>', got <what came>"."""
from __future__ import annotations

import torch


class TableFullError(RuntimeError):
    """A non-growable hash table ran out of room. `not_inserted` says how many keys were left out;
    every key that was inserted stays findable."""

    def __init__(self, op: str, not_inserted: int, capacity: int):
        self.not_inserted = int(not_inserted)
        self.capacity = int(capacity)
        super().__init__(f"pykernels.{op}: table is full (capacity {capacity}, growable=False): "
                         f"{not_inserted} key(s) were not inserted")


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
