"""Spoken replies in the page: each audio chunk is played the moment it arrives, through Web Audio.

Gradio's own streamed audio encodes to AAC and plays through HLS (first sound 1.3 s after submit
in an earlier test here, with an instant server). Instead the server sends each chunk as 16-bit PCM
in a hidden JSON component and PLAYER_JS schedules it right after the one before. A payload is one
chunk or a list of items; a chunk numbered 0 starts a new reply and cuts whatever still plays, and
a stop item cuts it too (barge-in in voice mode).
"""

import time
from typing import Any

from omni_local.media.pcm16 import base64_pcm16
from omni_local.protocol.events import AudioChunk

PLAYER_JS = """
(payload) => {
  if (!payload) return;
  const player = (window.omniLocalPlayer ??= {context: new AudioContext(), end: 0, sources: []});
  player.context.resume();
  const cut = () => {
    player.sources.forEach((source) => { try { source.stop(); } catch (error) {} });
    player.sources = [];
    player.end = 0;
  };
  for (const item of [payload].flat()) {
    if (item.stop) { cut(); continue; }
    if (item.pcm === undefined) continue;
    if (item.index === 0) cut();
    const bytes = Uint8Array.from(atob(item.pcm), (c) => c.charCodeAt(0));
    const pcm = new Int16Array(bytes.buffer);
    const buffer = player.context.createBuffer(1, pcm.length, item.rate);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 32767;  // media/pcm16.py's scale
    const source = player.context.createBufferSource();
    source.buffer = buffer;
    source.connect(player.context.destination);
    const start = Math.max(player.end, player.context.currentTime);
    source.start(start);
    player.end = start + buffer.duration;
    player.sources.push(source);
    // When it reached the page and when it starts to sound, after the server sent it (seconds).
    const now = Date.now() / 1000;
    (window.omniLocalChunks ??= []).push({index: item.index, arrived: now - item.sent_at,
                                          sounds: now - item.sent_at + (start - player.context.currentTime)});
  }
}
"""

STOP: dict[str, Any] = {"stop": True}


def audio_payload(chunk: AudioChunk, index: int) -> dict[str, Any]:
    """A chunk for the page's player: 16-bit PCM in base64, which JSON carries."""
    return {"index": index, "rate": chunk.sample_rate, "pcm": base64_pcm16(chunk.samples),
            "sent_at": time.time()}  # wall clock, so the page can tell how long the chunk took to reach it

