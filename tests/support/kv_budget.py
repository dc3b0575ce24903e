"""Settings whose KV holds only a few tokens, for tests of what the engine does when it is full."""

from omni_local.settings import Settings

DEMO_TOKEN_BYTES = 2048  # the demo's KV per token: 4 layers x K and V x 2 heads x 32 x float32


def kv_rows(settings: Settings, rows: int) -> Settings:
    """`settings` with device blocks for `rows` tokens of KV in all (whole blocks, and the pad block),
    so one request is at most that long too."""
    block = settings.kv_block_tokens
    rows = -(-rows // block) * block
    return settings.replace(max_context_tokens=rows, max_prompt_tokens=rows - block,
                            gpu_cache_bytes=(rows + block) * DEMO_TOKEN_BYTES)
