"""The engine's input stage: a conversation becomes a prompt here, and nowhere else.

builder.py renders the messages through the checkpoint's chat template (template_tokens.py: only
the template places control tokens) into token ids, the media items that stand for the images,
clips and videos, and each token's cache key; context_window.py leaves a long chat's earliest turns
out to fit the prompt limit; encoder_inputs.py makes the pixels and mel features of the media the
caches miss. It imports nothing else of the engine, so a message goes through it one way."""
