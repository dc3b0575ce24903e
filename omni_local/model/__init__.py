"""Loading Qwen3-Omni: a checkpoint directory or the built-in demo, and transformers workarounds."""

from omni_local.model.loader import LoadedModel, load_model, thinker_eos_token_ids

__all__ = ["LoadedModel", "load_model", "thinker_eos_token_ids"]
