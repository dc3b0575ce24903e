"""How much of the machine's memory the KV takes, decided at start-up once the weights are loaded.

On a GPU the host tier of the KV (host_arena.py: chats moved off the device) is allocated whole at
start-up and page-locked: memory the OS can neither swap out nor give to anything else. On the CPU
the Thinker's KV blocks (`gpu_cache_bytes`) live in the machine's memory too, beside the host tier,
and both fill as chats do. No fixed size suits every machine: 8 GiB is half of a 16 GB desktop.

The rule: the KV in host memory takes at most a quarter (1 / KV_SHARE) of the machine's memory left
after the weights held there (all of them on the CPU; on a GPU, the experts the memory plan left in
host memory, model/host_experts.py); the rest is for the OS,
the desktop's other programs, this process and the page cache the checkpoint is read through. On the
CPU the Thinker's blocks take that share first, up to `gpu_cache_bytes` (but never less than one
conversation, without which nothing runs); the host tier takes what is left, up to HOST_TIER_MOST.
A `host_cache_bytes` of 0 or more is taken as it is; -1 (AUTO) asks for the rule.

The machine's memory is what this process may use (machine_memory.py).
"""

from dataclasses import dataclass

from omni_local.engine.sizing.machine_memory import machine_memory_bytes
from omni_local.engine.sizing.memory_plan import GiB, Planned, least_conversation_kv_bytes, size
from omni_local.model.host_experts import held_in_host_memory
from omni_local.model.loader import LoadedModel
from omni_local.settings import EngineConfig

AUTO = -1  # host_cache_bytes: sized by the rule
KV_SHARE = 4
# The most the rule gives the host tier: what every machine took before (at full size 87,000 tokens
# of chats); page-locking it takes seconds (host_arena.py). Set host_cache_bytes for more.
HOST_TIER_MOST = 8 * GiB


@dataclass(frozen=True)
class HostPlan:
    machine: int | None  # bytes this process may use; None where they could not be read
    weights: int  # the weights' bytes held in host memory
    device_kv: int | None  # on the CPU, the Thinker's KV blocks; None on a GPU (memory_plan.py sizes those)
    host_tier: int

    def line(self) -> str:
        memory = size(self.machine) if self.machine is not None else "unknown (host KV tier at its most)"
        kv = f", KV {size(self.device_kv)}" if self.device_kv is not None else ""
        return (f"Host memory plan, {memory}: weights held there {size(self.weights)}{kv}, "
                f"host KV tier {size(self.host_tier)}")

    def applied(self, settings: Planned) -> Planned:
        """`settings` with the KV sized as planned."""
        sized = settings.replace(host_cache_bytes=self.host_tier)
        return sized if self.device_kv is None else sized.replace(gpu_cache_bytes=self.device_kv)


def plan_for(loaded: LoadedModel, settings: EngineConfig) -> HostPlan:
    """The plan for the model `loaded`, its weights in place, on this machine."""
    weights = held_in_host_memory(loaded.model) + sum(
        t.nbytes for t in (*loaded.model.parameters(), *loaded.model.buffers()) if t.device.type == "cpu")
    least_kv = least_conversation_kv_bytes(loaded.model, settings, loaded.dtype)
    return plan_host_memory(settings, machine_memory_bytes(), weights, least_kv, loaded.device.type == "cpu")


def plan_host_memory(settings: EngineConfig, machine: int | None, weights: int, least_kv: int, on_cpu: bool
                     ) -> HostPlan:
    """The KV's sizes in host memory for `machine` bytes of memory, `weights` of them held by weights
    (`least_kv`: one conversation's KV, the least the Thinker's blocks may hold)."""
    share = max(0, machine - weights) // KV_SHARE if machine is not None else None
    device_kv = None
    if on_cpu:
        device_kv = settings.gpu_cache_bytes if share is None else min(settings.gpu_cache_bytes, max(share, least_kv))
    if settings.host_cache_bytes != AUTO:
        tier = settings.host_cache_bytes
    elif share is None:
        tier = HOST_TIER_MOST
    else:
        tier = min(HOST_TIER_MOST, max(0, share - (device_kv or 0)))
    return HostPlan(machine, weights, device_kv, tier)
