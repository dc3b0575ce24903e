"""Tiny Thinking and Captioner checkpoints, written from the demo as Qwen publishes those two.

Both are the Thinker alone: their config.json names no Talker or Code2Wav (`enable_audio_output`
false, no `talker_config`), and their weights hold none. They keep the demo's Thinker (seeded random
weights, so deterministic), its tokenizer and processor. What tells them apart is the chat template:

- Thinking's is Instruct's with Qwen3's reasoning rules: a reply's reasoning (`reasoning_content`,
  or what its text holds before `</think>`) is written in a `<think>` block only for replies after
  the last question, so an earlier turn's reasoning is left out of the next prompt, and the
  generation prompt opens the block (`<|im_start|>assistant\\n<think>\\n`), so a reply starts
  reasoning and holds only `</think>`.
- The Captioner's is Instruct's own (it is Instruct fine-tuned to caption a clip; a user turn of
  one audio clip renders as it would there). Its files are then what Instruct exported without its
  Talker holds (`write_thinker_only`): only its name, Qwen's "...-Captioner", tells it apart.
"""

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from omni_local.model.chat_template import CHAT_TEMPLATE

# Instruct's assistant turn up to its tool calls: the text Thinking's template writes otherwise.
_ASSISTANT_TURN = "    {%- elif message.role == 'assistant' %}\n"
_TOOL_CALLS = "        {%- if message.tool_calls %}\n"
_ASSISTANT_WITH_REASONING = """\
    {%- elif message.role == 'assistant' %}
        {%- set answer = namespace(text='') %}
        {%- if message.content is string %}
            {%- set answer.text = message.content %}
        {%- elif message.content %}
            {%- for content in message.content %}
                {%- if 'text' in content %}
                    {%- set answer.text = answer.text + content.text %}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in answer.text %}
            {%- set reasoning_content = answer.text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set answer.text = answer.text.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + answer.text.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + answer.text }}
        {%- endif %}
"""
_LAST_QUESTION = """\
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
"""
_MESSAGES_LOOP = "{%- for message in messages %}\n"
_GENERATION_PROMPT = "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"


def _thinking_template() -> str:
    for piece in (_ASSISTANT_TURN, _TOOL_CALLS, _MESSAGES_LOOP, _GENERATION_PROMPT):
        assert CHAT_TEMPLATE.count(piece) == 1, f"Instruct's template changed: {piece!r}"
    start, end = CHAT_TEMPLATE.index(_ASSISTANT_TURN), CHAT_TEMPLATE.index(_TOOL_CALLS)
    template = CHAT_TEMPLATE[:start] + _ASSISTANT_WITH_REASONING + CHAT_TEMPLATE[end:]
    template = template.replace(_MESSAGES_LOOP, _LAST_QUESTION + _MESSAGES_LOOP)
    return template.replace(_GENERATION_PROMPT, "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}\n")


THINKING_TEMPLATE = _thinking_template()


def write_thinking(demo: Path, target: Path) -> Path:
    return write_thinker_only(demo, target, THINKING_TEMPLATE)


def write_captioner(demo: Path, target: Path) -> Path:
    """The Captioner, at `target`: a path whose name (or, in the Hugging Face cache, whose
    repository's) names the Captioner."""
    return write_thinker_only(demo, target)


def write_thinker_only(demo: Path, target: Path, template: str = CHAT_TEMPLATE) -> Path:
    """The demo without its Talker and Code2Wav, with `template` as its chat template."""
    shutil.copytree(demo, target)
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    del config["talker_config"], config["code2wav_config"]
    config["enable_audio_output"] = False
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    weights = load_file(target / "model.safetensors")
    thinker = {name: tensor for name, tensor in weights.items() if name.startswith("thinker.")}
    save_file(thinker, target / "model.safetensors", metadata={"format": "pt"})
    (target / "chat_template.jinja").write_text(template, encoding="utf-8")
    return target
