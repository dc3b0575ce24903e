"""What the engine keeps between requests: content digests and the Thinker's KV by prefix."""
