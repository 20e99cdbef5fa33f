"""Where the next iteration of a `TorchDataset` starts: ``(epoch, resume_epoch, resume_position)``,
in shared memory, so that ``set_epoch`` and ``load_state_dict`` called in the main process reach
DataLoader workers that already exist (``persistent_workers=True``), whose dataset is a copy.

An iteration of epoch ``e`` starts at ``resume_position`` if ``e == resume_epoch`` (a checkpoint
was loaded for that epoch), else at 0.

The values are a shared-memory int64 tensor: forked workers inherit the mapping, spawned ones
receive it through torch's multiprocessing pickler (whatever the DataLoader's
``multiprocessing_context``); a plain ``pickle``/``deepcopy`` takes a copy. Only the main process
writes, between iterations.
"""

from __future__ import annotations

import torch


class Cursor:
    def __init__(self, epoch: int = 0, resume_epoch: int = -1, resume_position: int = 0):
        self._values = torch.tensor([epoch, resume_epoch, resume_position], dtype=torch.int64).share_memory_()

    def start(self) -> tuple[int, int]:
        """``(epoch, position)`` of the next iteration."""
        epoch, resume_epoch, position = self._values.tolist()
        return epoch, (position if epoch == resume_epoch else 0)

    def set_epoch(self, epoch: int) -> None:
        self._values[0] = epoch

    def resume(self, epoch: int, position: int) -> None:
        self._values.copy_(torch.tensor([epoch, epoch, position], dtype=torch.int64))
