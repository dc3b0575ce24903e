"""The chat page's own look, offline (no font or script from elsewhere): its CSS, the context use's
bar, and the scripts the page runs in the browser for what Gradio's components leave undone."""

CHAT_LIST_ID = "chat-list"
METRICS_TITLE = "Metrics"  # a finished reply's metrics note (history.py), drawn as one line

PAGE_CSS = """
#omni-header p { margin: 0; }
/* The sidebar: New chat, search, the chats (the shown one highlighted), its actions, the settings. */
#omni-sidebar .sidebar-content { display: flex; flex-direction: column; gap: var(--spacing-lg); }
#chat-list { max-height: 45vh; overflow-y: auto; }
#chat-list .wrap:has(> label) { display: flex; flex-direction: column; gap: 2px; }
#chat-list label {
  display: flex; width: 100%; margin: 0; padding: var(--spacing-md) var(--spacing-lg); border: none;
  border-radius: var(--radius-md); background: transparent; box-shadow: none; cursor: pointer;
}
#chat-list label:hover { background: var(--background-fill-secondary); }
#chat-list label.selected { background: var(--color-accent-soft); font-weight: 600; }
#chat-list label input { position: absolute; opacity: 0; pointer-events: none; }
#chat-list label span {
  margin: 0; overflow: hidden; white-space: nowrap; text-overflow: ellipsis; font-size: var(--text-md);
}
#chat-list::after {
  display: block; color: var(--body-text-color-subdued); font-size: var(--text-sm); padding: 0 var(--spacing-lg);
}
#chat-actions { gap: var(--spacing-md); flex-wrap: nowrap; }
footer > .divider:last-child { display: none; }  /* Gradio's, left after its only link */
/* An empty chat: what can be done in it. */
.empty-chat-hint {
  color: var(--body-text-color-subdued); text-align: left; max-width: 28rem; padding: 0 var(--spacing-xl);
}
.empty-chat-hint h3 { color: var(--body-text-color); margin-bottom: var(--spacing-md); }
.empty-chat-hint li { margin: var(--spacing-sm) 0; }
/* A reply's metrics: one quiet line under it, cut to the width (all of it on hover; a click unfolds it). */
.metrics-line {
  border: none !important; padding: 0 !important; margin-top: var(--spacing-sm); background: none !important;
}
/* A note of its own (one bubble a message): no bubble around it. */
.message.bot:has(> [data-testid=bot] > .metrics-line:only-child) {
  background: none !important; border: none !important; box-shadow: none !important;
  padding: 0 var(--spacing-md) !important;
}
.metrics-line > .title { display: none !important; }
/* Shown at once, not slid open as Gradio opens a titled message (its inline height runs from 0). */
.metrics-line > .content {
  display: block !important; height: auto !important; opacity: 1 !important; padding: 0 !important; cursor: pointer;
}
.metrics-line .message-content, .metrics-line .prose, .metrics-line p {
  margin: 0 !important; font-size: var(--text-sm) !important; line-height: 1.4 !important;
  color: var(--neutral-500) !important; opacity: 1 !important;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis;
}
.metrics-line.unfolded :is(.message-content, .prose, p) { white-space: normal; }
/* The context use, beside the message box: a bar and its figures. */
#context-use { padding: 0 var(--spacing-sm); }
.context-meter { display: flex; align-items: center; gap: var(--spacing-md); font-size: var(--text-md); }
.context-meter .bar {
  flex: 0 0 8rem; height: 6px; border-radius: 3px; background: var(--border-color-primary); overflow: hidden;
}
.context-meter .bar span { display: block; height: 100%; background: var(--color-accent); }
.context-meter.nearly-full .bar span { background: var(--error-icon-color, #dc2626); }
.context-meter .figures { color: var(--body-text-color); }
"""

# The context use (the component's value, "Context: 702 of 8,192 tokens", or "" before a reply) as a
# bar and its figures: a template of Gradio's HTML component, whose ${...} are JavaScript.
CONTEXT_USE_HTML = """${(() => {
  if (!value) return '';
  const [used, most] = value.match(/[\\d,]+/g).map((figure) => Number(figure.replaceAll(',', '')));
  const share = Math.min(100, 100 * used / most);
  const full = share >= 90 ? ' nearly-full' : '';
  return `<div class="context-meter${full}" title="How much of the model's context this chat fills">
    <div class="bar" role="meter" aria-label="Context use" aria-valuemin="0" aria-valuemax="${most}"
         aria-valuenow="${used}">
      <span style="width: ${share.toFixed(1)}%"></span></div>
    <span class="figures">${value}</span></div>`;
})()}"""

# Phone-sized windows: Gradio opens the sidebar over the chat; it starts closed there, and closes
# after New chat or a chat is chosen, so the message box is usable without closing anything first.
PHONE_WIDTH_PX = 768
CLOSE_SIDEBAR_ON_PHONES_JS = (
    f"() => {{ if (window.innerWidth < {PHONE_WIDTH_PX}) "
    "document.querySelector('.sidebar.open .toggle-button')?.click(); }"
)

# The search's result, {query, ids}: the ids of the chats it found (null: no search, all shown) hide
# the others, by a style rule, so that it holds while the list is drawn again as chats are saved. The
# list says which search it shows (data-searched).
FILTER_CHATS_JS = f"""(found) => {{
  const ids = found?.ids ?? null;
  const style = document.getElementById('chat-filter')
    ?? document.head.appendChild(Object.assign(document.createElement('style'), {{id: 'chat-filter'}}));
  const kept = (ids ?? []).map((id) => `:has(input[value="${{id}}"])`).join(', ');
  const hidden = `#{CHAT_LIST_ID} label${{kept ? `:not(${{kept}})` : ''}} {{ display: none !important; }}`;
  const none = `#{CHAT_LIST_ID}::after {{ content: "No chat matches the search"; }}`;
  style.textContent = ids === null ? '' : ids.length ? hidden : hidden + none;
  const list = document.getElementById('{CHAT_LIST_ID}');
  if (list) list.dataset.searched = found?.query ?? '';
}}"""

# Run once the page loads. Gradio's ChatInterface empties the message box's placeholder while a
# reply streams and never gives it back; a reply's metrics note is a titled message like any other,
# told apart here by its title and drawn as one line (PAGE_CSS). Both are kept as the chat redraws.
PAGE_JS = f"""() => {{
  let placeholder = '';
  const tidy = () => {{
    const box = document.querySelector('.multimodal-textbox textarea');
    if (box) {{
      placeholder ||= box.placeholder;
      if (!box.placeholder && placeholder) box.placeholder = placeholder;
    }}
    document.querySelectorAll('.thought-group:not(.metrics-line)').forEach((group) => {{
      const title = group.querySelector(':scope > .title');
      if (title?.textContent.trim() !== '{METRICS_TITLE}') return;
      group.classList.add('metrics-line');
      group.querySelector(':scope > .content')?.addEventListener('click', () => group.classList.toggle('unfolded'));
    }});
    document.querySelectorAll('.metrics-line > .content').forEach((content) => {{
      if (content.title !== content.textContent.trim()) content.title = content.textContent.trim();
    }});
  }};
  new MutationObserver(tidy).observe(document.body, {{childList: true, subtree: true, characterData: true,
                                                      attributes: true, attributeFilter: ['placeholder']}});
  tidy();
}}"""

# Gradio's footer keeps its link to the page's API; its Settings (theme, language, screen recording,
# which read as the app's own, and whose theme buttons draw glyphs its fonts lack) and its credit go.
FOOTER_LINKS = ["api"]


def launch_style() -> dict[str, object]:
    """The page's look, as `launch()` takes it."""
    return {"css": PAGE_CSS, "js": PAGE_JS, "footer_links": FOOTER_LINKS}
