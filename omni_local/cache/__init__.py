"""What the engine keeps of media between requests: content digests and the encoder cache, in
private folders. (The KV's prefix cache lives in engine/, beside the KV storage it drives.)"""
