"""How much of each memory the engine takes, decided once at start-up.

memory_plan.py splits the GPU's memory before any weight is read (the weights, the engine's working
memory, the KV up to `gpu_cache_bytes`) from the sizes the forwards' parts need (kv_sizes.py);
expert_placement.py chooses which experts wait in host memory when the floors do not fit, bounded by
the machine's memory (machine_memory.py); host_memory.py sizes the KV kept in host memory once the
weights are loaded. It stands above the forward and memory rooms, whose sizes it reads."""
