"""The machine's memory this process may use: the physical memory, or a cgroup's limit (a
container's, or a service's) where that is lower. The host memory plan (host_memory.py) sizes the
KV's host tier from it, the GPU memory plan (memory_plan.py) bounds the experts it puts in host
memory by it."""

import os
from pathlib import Path


def machine_memory_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"),
                         cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory this process may use: the physical memory, or its cgroups' lowest limit where
    lower; None where neither can be read (no sysconf, as on Windows)."""
    known = [count for count in (_physical_bytes(), *_cgroup_limits(proc_cgroup, cgroups)) if count]
    return min(known, default=None)


def _physical_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_limits(proc_cgroup: Path, cgroups: Path) -> list[int]:
    """The memory limits of the process's cgroup and of those above it (an inner one may set none
    while its parent does): cgroup v2's memory.max, v1's memory controller's memory.limit_in_bytes."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = cgroups, "memory.max"
        elif "memory" in controllers.split(","):
            root, name = cgroups / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = Path(path).parts[1:]  # below the root, "/" first
        limits += [limit for i in range(len(parts) + 1) if (limit := _limit(root.joinpath(*parts[:i]) / name))]
    return limits


def _limit(file: Path) -> int | None:
    """A limit file's bytes; None for none ('max') or no file. (v1 writes a huge number for none.)"""
    try:
        text = file.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
