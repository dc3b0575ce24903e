"""The engine's forward passes: what runs the model on the device, one turn's work at a time.

thinker.py and talker.py run the Thinker and the Talker over one shared decoder-stack forward
(decoder_stack.py: the compiled regions around attention; fused_qkv.py: one projection for q, k, v;
rope_positions.py: M-RoPE positions from the prompt's media); prefill_chunks.py prepares a prompt's
tail for its prefill and cuts it into chunks; sampling.py chooses tokens on the device, the
Thinker's and the Talker's; speech.py makes a spoken reply's frames and vocoder.py turns them into
sound (Code2Wav in chunks); encoders.py and media_encoder.py turn media into the Thinker's input
embeddings, through the encoder cache; cuda_graphs.py captures and replays batched steps and
prefills; moe/ runs every MoE layer's experts by a backend; batch_invariant.py is what the
deterministic setting swaps in. It reads and writes the KV through memory/; of the engine's own
files it imports only phases.py (the spans it marks), never the scheduler."""
