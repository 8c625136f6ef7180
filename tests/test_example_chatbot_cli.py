"""The terminal chat example through a pseudo-terminal, as a person types into it.

Runs ``python -m examples.chatbot_cli`` on SmolLM2-135M (draft and main) under pexpect: asks
a question, reads the streamed answer and the timing line, changes the keep rate, looks at
the kept passages, tries bad input, and quits.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.terminal, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
TIMING = re.compile(r"\[TTFT (\d+\.\d+) s \(draft [\d.]+ s \+ main prefill [\d.]+ s\).*kept (\d+)/(\d+) tokens")


@pytest.fixture(scope="module")
def chat():
    """One chat process for the module: the bad-input test runs first, the last test quits."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
    child = pexpect.spawn(
        sys.executable, ["-m", "examples.chatbot_cli", "--top-k", "3", "--max-new-tokens", "24"],
        cwd=str(ROOT), env=env, encoding="utf-8", timeout=600, dimensions=(40, 200),
    )
    log = ROOT / "test-artifacts"
    log.mkdir(exist_ok=True)
    child.logfile_read = open(log / "chatbot_cli_test.log", "w")  # noqa: SIM115 - closed below
    try:
        child.expect("you> ")
        yield child
    finally:
        if child.isalive():
            child.terminate(force=True)
        child.logfile_read.close()


def test_bad_input_gets_a_readable_message(chat):
    for line, message in [
        ("", "the question is empty"),
        ("/keep 2", "/keep needs a number in (0, 1]"),
        ("/keep abc", "/keep needs a number in (0, 1]"),
        ("/full maybe", "use /full on or /full off"),
        ("/passages", "no answer yet"),
        ("/nope", "unknown command"),
    ]:
        chat.sendline(line)
        chat.expect_exact(message)
        chat.expect("you> ")
        assert "Traceback" not in chat.before


def test_ask_change_keep_rate_and_quit(chat):
    chat.sendline("Who is the winter physician at Tindra Point?")
    chat.expect("bot> ")
    chat.expect(TIMING)  # the answer streamed before it, then the one-line summary
    answer = chat.before.strip()
    assert answer, "empty answer"
    assert "Traceback" not in answer
    prompt_tokens = int(chat.match.group(3))
    assert 0 < int(chat.match.group(2)) < prompt_tokens  # SpecPrefill kept a part of the prompt
    chat.expect("you> ")

    chat.sendline("/keep 0.3")
    chat.expect(r"keep rate: 0\.3")
    chat.expect("you> ")

    chat.sendline("/passages")
    chat.expect(r" 1\. \S+#\d+ +\d+/\d+")
    chat.expect("you> ")
    assert "kept:" in chat.before

    chat.sendline("/quit")
    chat.expect("bye")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_missing_documents_exit_with_a_message(tmp_path):
    result = pexpect.run(
        f"{sys.executable} -m examples.chatbot_cli --docs {tmp_path / 'nothing-here'}",
        cwd=str(ROOT), env={**os.environ, "HF_HUB_OFFLINE": "1"}, encoding="utf-8", withexitstatus=True,
        timeout=300,
    )
    output, status = result
    assert status == 2, output
    assert "error: no such file or directory" in output and "Traceback" not in output
