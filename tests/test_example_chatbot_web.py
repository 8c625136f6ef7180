"""The web chat example in a real headless Chromium, as a person uses it.

The app runs in its own environment (.venv-web, built by examples/chatbot_web/setup_venv.sh)
on 127.0.0.1 and is stopped by PID; Playwright drives Debian's /usr/bin/chromium. A
screenshot of the answered page is saved under test-artifacts/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.chatbot_web import browser

pytestmark = [pytest.mark.real_model, pytest.mark.browser, pytest.mark.timeout(900)]

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
QUESTION = "Who is the winter physician at Tindra Point?"


@pytest.fixture(scope="module")
def app_url():
    try:
        browser.check_setup()  # a missing .venv-web must fail, not skip
    except RuntimeError as error:
        pytest.fail(str(error))
    ARTIFACTS.mkdir(exist_ok=True)
    with browser.running_app(
        ["--top-k", "3", "--keep-rate", "0.3", "--max-new-tokens", "24"], log=ARTIFACTS / "chatbot_web_test.log"
    ) as url:
        yield url


@pytest.fixture()
def page(app_url):
    with browser.browser_page() as page:
        page.goto(app_url)
        page.locator("#question textarea").wait_for(timeout=60_000)
        yield page


# Records every length the last chat message takes, to see the answer grow token by token.
WATCH_ANSWER = """() => {
  window.__lengths = new Set();
  const chat = document.querySelector('#chat');
  new MutationObserver(() => {
    const messages = chat.querySelectorAll('.message');
    if (messages.length >= 2) window.__lengths.add(messages[messages.length - 1].innerText.trim().length);
  }).observe(chat, {subtree: true, childList: true, characterData: true});
}"""


def test_answer_streams_with_ttft_and_kept_tokens(page):
    page.evaluate(WATCH_ANSWER)
    page.locator("#question textarea").fill(QUESTION)
    page.locator("#ask").click()
    # The question shows in the chat as soon as it is sent, before the answer starts.
    page.locator("#chat").get_by_text(QUESTION).wait_for(timeout=120_000)
    page.locator("#timing").get_by_text("TTFT with SpecPrefill").wait_for(timeout=600_000)
    page.screenshot(path=str(ARTIFACTS / "chatbot_web.png"), full_page=True)

    messages = page.locator("#chat .message").all_inner_texts()
    answer = [m for m in messages if QUESTION not in m]
    assert answer and answer[-1].strip(), f"no answer in the chat: {messages}"
    lengths = page.evaluate("Array.from(window.__lengths).filter(n => n > 0).length")
    assert lengths >= 2, "the answer did not stream: it appeared in one piece"

    timing = page.locator("#timing").inner_text()
    assert "TTFT with SpecPrefill:" in timing and " s" in timing, timing
    assert "TTFT with full prefill:" in timing, timing  # compared by default
    assert "Keep ratio:" in timing, timing

    kept = page.locator(browser.KEPT_SELECTOR)
    dropped = page.locator('#kept .token.highlighted[style*="229, 231, 235"]')
    assert kept.count() >= 1 and dropped.count() >= 1, (kept.count(), dropped.count())
    assert "kept" in page.locator("#kept").inner_text()  # per-passage headers and legend
    table = page.locator("#passages").inner_text()
    assert "kept / tokens" in table and "%" in table, table
    assert "Traceback" not in page.content()

    # A follow-up is a second turn of the same chat, with its own timing.
    page.locator("#question textarea").fill("And when is the summer physician on station?")
    page.locator("#ask").click()
    page.wait_for_function(
        "old => { const t = document.querySelector('#timing'); return t && t.innerText.includes('TTFT') "
        "&& t.innerText !== old; }",
        arg=timing, timeout=600_000,
    )
    assert page.locator("#chat .message").count() >= 4


def test_uploaded_file_is_answered_from(page, tmp_path):
    notes = tmp_path / "boat-notes.md"
    notes.write_text(
        "# Boat shed\n\nThe key of the boat shed hangs in the blue cabinet of the radio room. "
        "The workboat Tindra II has a red hull and seats for six.\n"
    )
    page.locator("#upload input[type=file]").set_input_files(str(notes))
    page.locator("#upload-status").get_by_text("Indexed 1 passages from boat-notes.md").wait_for(timeout=120_000)
    browser.ask(page, "Where does the key of the boat shed hang?")
    assert "boat-notes.md#0" in page.locator("#passages").inner_text()
    assert "boat-notes.md#0" in page.locator("#kept").inner_text()
    assert "Traceback" not in page.content()


def test_bad_input_shows_a_readable_message(page, tmp_path):
    # Empty question.
    page.locator("#ask").click()
    page.locator("#status").get_by_text("question is empty").wait_for(timeout=60_000)

    # Uploaded documents chosen, nothing uploaded.
    page.get_by_label("My uploaded files").check()
    page.locator("#question textarea").fill(QUESTION)
    page.locator("#ask").click()
    page.locator("#status").get_by_text("no documents").wait_for(timeout=60_000)

    # A file with no text.
    empty = tmp_path / "empty.md"
    empty.write_text("   \n")
    page.locator("#upload input[type=file]").set_input_files(str(empty))
    page.locator("#upload-status").get_by_text("no text").wait_for(timeout=120_000)

    # A huge upload (over the 2 MB limit; the File component may keep the previous file too).
    huge = tmp_path / "huge.txt"
    huge.write_text("The station has a very long manual. " * 90_000)  # ~3.2 MB
    page.locator("#upload input[type=file]").set_input_files(str(huge))
    page.locator("#upload-status").get_by_text("too large").wait_for(timeout=120_000)

    # The vLLM server backend with no server behind its URL.
    page.get_by_label("Bundled handbook").check()
    page.get_by_text("Models and backend").click()
    page.get_by_label("vLLM server", exact=True).check()
    page.get_by_label("vLLM server URL (vLLM backend only)").fill(f"http://127.0.0.1:{browser.free_port()}")
    page.locator("#ask").click()
    page.locator("#status").get_by_text("Loading models").wait_for(timeout=60_000)
    page.locator("#status").get_by_text("⚠️").wait_for(timeout=300_000)
    message = page.locator("#status").inner_text()
    (ARTIFACTS / "chatbot_web_vllm_down.txt").write_text(message)
    assert "Traceback" not in message and len(message) < 2000, message

    page.screenshot(path=str(ARTIFACTS / "chatbot_web_errors.png"), full_page=True)
    assert "Traceback" not in page.content()
