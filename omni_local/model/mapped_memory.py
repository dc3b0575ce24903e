"""Host memory a GPU's kernels read in place: page-locked host memory, seen by torch as a CUDA tensor.

Under unified virtual addressing (every 64-bit process on Linux) host memory registered with
`cudaHostRegister` is mapped into the GPU's address space, at its host address where the GPU can use
the host pointer for registered memory (CUDA's cudaDevAttrCanUseHostPointerForRegisteredMem, which
x86-64 Linux sets; tests/models/test_host_experts.py checks it on the GPU it runs on). A kernel handed that
address reads the bytes over the bus as they are, with no copy and no wait on the host, inside a
CUDA graph too. `mapped_empty` hands torch (and so Triton and the MoE kernels) such memory as a
CUDA tensor, through the `__cuda_array_interface__` protocol: torch wraps the pointer without
copying, and keeps the host buffer alive while any view of it is.

Registered, not allocated by torch's pinned allocator (`pin_memory()`, cudaHostAlloc), which would
round each buffer up to a power of two of bytes and keep it (an int4 layer's gate_up values, 192
MiB at full size, would pin 256). None of it is the caching allocator's: `torch.cuda.memory_allocated`
does not count it.
"""

import math
import mmap
import weakref

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context's, and mapped (the default under
# unified addressing; said, not assumed).
_REGISTER_FLAGS = 1 | 2


class _Interface:
    """The object torch wraps (`__cuda_array_interface__`, version 3): the bytes of `host`, which it
    keeps; torch holds it for as long as any tensor made from it lives."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {"shape": (host.nbytes,), "typestr": "|u1", "data": (host.data_ptr(), False),
                                         "version": 3, "strides": None}


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor on `device` whose bytes live in page-locked host memory: kernels read
    and write them over the bus; on the CPU, an ordinary tensor (host memory is its device's)."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    return _mapped(shape, dtype, device)[0]


def mapped_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on any device) copied into mapped host memory for `device` (`mapped_empty`); on the
    CPU, `tensor` there as it is."""
    if device.type != "cuda":
        return tensor.to(device)
    mapped, host = _mapped(tuple(tensor.shape), tensor.dtype, device)
    # From the host, a plain memcpy into the same bytes; from the GPU, a device copy.
    (host if tensor.device.type == "cpu" else mapped).copy_(tensor)
    return mapped


def _mapped(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of `shape` on `device` over page-locked host memory, and the same bytes as a CPU tensor."""
    count = math.prod(shape) * dtype.itemsize
    # Whole pages of their own: a page that another buffer shares cannot be registered twice
    # (cudaErrorHostMemoryAlreadyRegistered), and torch's small CPU allocations share pages.
    span = -(-max(count, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    memory = torch.empty(span + mmap.PAGESIZE, dtype=torch.uint8)
    start = -memory.data_ptr() % mmap.PAGESIZE
    host = memory[start : start + span]
    with torch.cuda.device(device):
        error = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), span, _REGISTER_FLAGS))
        if error:
            raise MemoryError(f"could not page-lock {count:,} bytes of host memory for weights read by the GPU "
                              f"(cudaError {error}): the machine's memory is short; keep more experts on the GPU "
                              "(experts_on_gpu) or use smaller weights")
        interface = _Interface(host)
        weakref.finalize(interface, _unregister, host)  # when the last tensor over it is freed
        # The device named, so that torch never takes the default device (the CPU) and copies there;
        # the assertion says nothing was copied.
        mapped = torch.as_tensor(interface, device=torch.device("cuda", torch.cuda.current_device()))
        assert mapped.is_cuda and mapped.data_ptr() == host.data_ptr(), "the host memory was copied, not mapped"
    return (mapped[:count].view(dtype).view(shape), host[:count].view(dtype).view(shape))


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
