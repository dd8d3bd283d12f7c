"""Torch devices named by users: parsed once, torch imported only when one is named."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["torch_device"]


def torch_device(option: str, device: object) -> torch.device | None:
    """`device` parsed: `TypeError` for another type, `ValueError` for a string torch
    cannot parse. Whether the device exists on this machine is not checked here: using
    it fails with torch's error."""
    if device is None:
        return None
    import torch

    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"{option} must be a str, a torch.device or None, "
            f"got {type(device).__name__} {device!r}"
        )
    try:
        return torch.device(device)
    except RuntimeError as error:  # torch's parse error
        raise ValueError(
            f"{option} must be a torch device such as 'cpu', 'cuda' or 'cuda:0', "
            f"got {device!r} ({error})"
        ) from error
