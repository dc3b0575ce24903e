"""The KV's share of the machine's memory (engine/sizing/host_memory.py): with host_cache_bytes = -1 the host
tier is a quarter of the memory the weights leave, at most 8 GiB; on the CPU the Thinker's KV blocks
come out of that quarter first; a host_cache_bytes that is set is taken as it is; and the machine's
memory is the lowest of the physical memory and the process's cgroup limits."""

import logging
import os
from pathlib import Path

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.engine.sizing import host_memory
from omni_local.engine.sizing.host_memory import HOST_TIER_MOST, machine_memory_bytes, plan_host_memory
from omni_local.model import load_model
from omni_local.settings import Settings

MiB, GiB = 1 << 20, 1 << 30
ONE_CONVERSATION = 40 * MiB
AUTO = Settings(host_cache_bytes=-1, gpu_cache_bytes=4 * GiB)


def test_on_a_gpu_the_host_tier_is_a_quarter_of_the_machines_memory_at_most_8_gib():
    tiers = {machine: plan_host_memory(AUTO, machine, 0, ONE_CONVERSATION, on_cpu=False)
             for machine in (16 * GiB, 24 * GiB, 32 * GiB, 64 * GiB)}

    assert {machine: plan.host_tier for machine, plan in tiers.items()} == {
        16 * GiB: 4 * GiB, 24 * GiB: 6 * GiB, 32 * GiB: 8 * GiB, 64 * GiB: 8 * GiB}
    assert HOST_TIER_MOST == 8 * GiB
    assert all(plan.device_kv is None for plan in tiers.values())  # the GPU's KV is the GPU plan's


def test_on_the_cpu_the_kv_blocks_then_the_host_tier_share_a_quarter_of_what_the_weights_leave():
    roomy = plan_host_memory(AUTO, 32 * GiB, 8 * GiB, ONE_CONVERSATION, on_cpu=True)
    desktop = plan_host_memory(AUTO, 16 * GiB, 8 * GiB, ONE_CONVERSATION, on_cpu=True)

    assert (roomy.device_kv, roomy.host_tier) == (4 * GiB, 2 * GiB)  # 6 GiB: gpu_cache_bytes, then the rest
    assert (desktop.device_kv, desktop.host_tier) == (2 * GiB, 0)


def test_on_the_cpu_the_kv_blocks_hold_one_conversation_however_little_memory_the_weights_leave():
    plan = plan_host_memory(AUTO, 10 * GiB, 10 * GiB - 64 * MiB, ONE_CONVERSATION, on_cpu=True)

    assert (plan.device_kv, plan.host_tier) == (ONE_CONVERSATION, 0)


def test_a_host_cache_bytes_that_is_set_is_taken_as_it_is():
    for host_cache_bytes in (0, 1 * GiB, 12 * GiB):
        settings = AUTO.replace(host_cache_bytes=host_cache_bytes)
        for on_cpu in (False, True):
            assert plan_host_memory(settings, 16 * GiB, 0, ONE_CONVERSATION, on_cpu).host_tier == host_cache_bytes


def test_where_the_machines_memory_is_unknown_the_tier_is_8_gib_and_the_blocks_gpu_cache_bytes():
    plan = plan_host_memory(AUTO, None, 0, ONE_CONVERSATION, on_cpu=True)

    assert (plan.device_kv, plan.host_tier) == (4 * GiB, 8 * GiB)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_machines_memory_is_the_lowest_of_the_physical_memory_and_the_cgroups_limits(tmp_path):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert physical > 3 * GiB
    proc, root = tmp_path / "cgroup", tmp_path / "sys"
    write(proc, "0::/\n")
    write(root / "memory.max", "max\n")
    assert machine_memory_bytes(proc, root) == physical

    write(proc, "0::/user/app\n")  # cgroup v2: the lowest of its memory.max and those above it
    write(root / "user" / "memory.max", f"{1 * GiB}\n")
    write(root / "user" / "app" / "memory.max", "max\n")
    assert machine_memory_bytes(proc, root) == 1 * GiB

    write(proc, "7:pids:/\n4:cpu,memory:/box/one\n")  # cgroup v1: the memory controller's
    write(root / "memory" / "box" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    write(root / "memory" / "box" / "one" / "memory.limit_in_bytes", f"{3 * GiB}\n")
    assert machine_memory_bytes(proc, root) == 3 * GiB

    assert machine_memory_bytes(tmp_path / "no such file", root) == physical


def held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("quarter, blocks, tier", [(96 * MiB, 64 * MiB, 32 * MiB), (48 * MiB, 48 * MiB, 0)])
def test_the_apps_kv_on_the_cpu_follows_the_machines_memory(demo_settings, demo_checkpoint, monkeypatch, caplog,
                                                            quarter, blocks, tier):
    caplog.set_level(logging.INFO, logger="omni_local")
    settings = demo_settings.replace(device="cpu", host_cache_bytes=-1)
    assert settings.gpu_cache_bytes == 64 * MiB
    machine = held_bytes(load_model(settings).model) + 4 * quarter
    monkeypatch.setattr(host_memory, "machine_memory_bytes", lambda: machine)

    with OmniLocal(settings) as app:
        engine = app.backend.engine
        kv = engine.runner.kv
        block_bytes = kv.shape.block_bytes(kv.dtype)
        assert (engine.settings.gpu_cache_bytes, engine.settings.host_cache_bytes) == (blocks, tier)
        assert kv.allocated_bytes == blocks // block_bytes * block_bytes
        assert (engine.cache.arena.blocks if engine.cache.arena else 0) == tier // block_bytes
        assert app.session().send("Hello there", max_new_tokens=4).result().tokens.generated > 0

    assert (f"Host memory plan, {machine / MiB:.1f} MiB: weights held there {(machine - 4 * quarter) / MiB:.1f} MiB, "
            f"KV {blocks / MiB:.1f} MiB, host KV tier {tier / MiB:.1f} MiB") in caplog.text
