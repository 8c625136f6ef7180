"""Drive the web app as a person would: start it, open it in headless Chromium, ask, look.

Used by the browser test (tests/test_example_chatbot_web.py) and to regenerate the README
screenshot. Runs in the core ``.venv`` (Playwright is the driver there); the app itself runs
in ``.venv-web``. Chromium is Debian's (``apt-get install chromium``), never Playwright's
download. Regenerate the screenshot with::

    .venv/bin/python -m examples.chatbot_web.browser docs/images/chatbot_web.png
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WEB_PYTHON = ROOT / ".venv-web" / "bin" / "python"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
SETUP_HINT = "run `bash examples/chatbot_web/setup_venv.sh` (or `make web-setup`) first"
KEPT_SELECTOR = '#kept .token.highlighted[style*="74, 222, 128"]'  # green = kept (KEPT_COLORS)


def _log_path(name: str) -> Path:
    """Where the app's output goes: test-artifacts/ (gitignored)."""
    folder = ROOT / "test-artifacts"
    folder.mkdir(exist_ok=True)
    return folder / f"chatbot_web_{name}.log"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_setup() -> None:
    """Raise with the setup command when .venv-web or Chromium is missing."""
    if not WEB_PYTHON.exists():
        raise RuntimeError(f"{WEB_PYTHON} is missing: the web app has its own environment; {SETUP_HINT}")
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: apt-get update && apt-get install -y chromium")


@contextlib.contextmanager
def running_app(args: Sequence[str] = (), *, log: Path | None = None, ready_s: float = 420) -> Iterator[str]:
    """Start the app on 127.0.0.1 and a free port; yield its URL; stop it by PID afterwards."""
    check_setup()
    port = free_port()
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [str(WEB_PYTHON), "-m", "examples.chatbot_web", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if process.poll() is not None:
                tail = log.read_text()[-3000:] if log else ""
                raise RuntimeError(f"the web app exited with code {process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the web app did not answer on {url} within {ready_s:.0f} s")
            time.sleep(1)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # its own session: the app and nothing else
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A page in Debian's headless Chromium, with no network besides loopback."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def ask(page: Any, question: str, *, timeout_s: float = 420) -> None:
    """Type ``question``, press Ask, and wait until the answer's timing is shown."""
    page.locator("#question textarea").fill(question)
    page.locator("#ask").click()
    page.locator("#timing").get_by_text("TTFT with SpecPrefill").wait_for(timeout=timeout_s * 1000)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Screenshot the web app answering a question.")
    parser.add_argument("output", nargs="?", default=str(ROOT / "docs" / "images" / "chatbot_web.png"))
    parser.add_argument("--question", default="On what date was Tindra Point Research Station officially opened?")
    # A long RAG prompt (20 passages, ~2.3k tokens) at keep 10%: where the draft's cost pays off.
    parser.add_argument("--app-args", default="--models qwen --top-k 20 --keep-rate 0.1 --max-new-tokens 48",
                        help="arguments for the app (default: %(default)s)")
    parser.add_argument("--max-height", type=int, default=1600,
                        help="keep the top this many pixels of the page; 0: the whole page (default: %(default)s)")
    args = parser.parse_args(argv)
    with running_app(args.app_args.split(), log=_log_path("screenshot")) as url:
        with browser_page(height=900) as page:
            page.goto(url)
            ask(page, args.question)
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            height = page.evaluate("document.documentElement.scrollHeight")
            if args.max_height:
                height = min(height, args.max_height)  # 20 passages' kept text runs to ~4,600 px
            page.screenshot(path=args.output, full_page=True, clip={"x": 0, "y": 0, "width": 1400, "height": height})
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
