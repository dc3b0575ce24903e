"""Copies between the host and the device that do not make the host wait for the device.

On CUDA, a copy from or to pageable host memory waits for the stream: the decode loop would stop
queueing work at every step. These copies go through pinned memory with `non_blocking=True`. The
pinned blocks come from torch's caching host allocator, which records an event with each such
copy and hands a block out again only once its event has passed: a block is never rewritten while
its copy is still queued, however soon the tensor is dropped. On the CPU the same calls just copy.
"""

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU tensor `host` on `device`, the copy queued without waiting for the device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_from_host(target: torch.Tensor, host: torch.Tensor) -> None:
    """Copy CPU tensor `host` into `target` (a device buffer), queued without waiting for the device."""
    target.copy_(host.pin_memory() if target.is_cuda else host, non_blocking=True)


class Readback:
    """A device tensor's values on their way to the host: the copy is queued now, and `tolist`
    waits for it (and for the work queued before it), not for the work queued since."""

    def __init__(self, values: torch.Tensor) -> None:
        self._copied: torch.cuda.Event | None = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = values

    def tolist(self) -> list:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
