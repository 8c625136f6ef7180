"""The OpenAI Agents SDK runs a tool loop through the gateway's Responses API (issue 62, item 3).

The SDK's default model calls ``/v1/responses`` and sends the whole conversation each step: the
question, then the response's ``function_call`` item as it came and the tool's output, tools still
offered. The gateway serves the tiny engine whose template renders tools, its backend scripted
(``ScriptedBackend``): the first step calls ``search``, the second answers. The SDK must parse
both responses, run the tool with the model's arguments and return the answer; the tool's
output reaches the model as prunable passages (the gateway's ``specprefill`` report).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = [pytest.mark.full, pytest.mark.timeout(600)]
agents = pytest.importorskip("agents")

DOCS = ["The sky is blue. The quick brown fox jumps over the lazy dog. " * 6,
        "The passkey is 48213. The sky is blue. " * 6,
        "Answer the question using the context. The fox jumps. " * 6]
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "passkey"}}\n</tool_call>'
ANSWER = "The passkey is 48213."


def test_an_agents_sdk_tool_loop_through_the_gateway():
    from openai import AsyncOpenAI
    from servers import app_in_thread

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.gateway import create_app
    from specprefill_rag.testing import ScriptedBackend, tiny_engine

    engine = tiny_engine(tools=True)
    backend = ScriptedBackend(engine.backend, "Ready.", CALL, ANSWER)  # the warm-up, then the two steps
    searched: list[str] = []

    @agents.function_tool
    def search(query: str) -> str:
        """Search the station's documents."""
        searched.append(query)
        return "\n\n".join(DOCS)

    agents.set_tracing_disabled(True)  # nothing leaves this machine
    with app_in_thread(create_app(SpecPrefillEngine(backend, engine.draft, engine.config))) as port:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/ready", timeout=60) as ready:  # the warm-up is over
            assert json.load(ready)["ready"] is True
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=AsyncOpenAI(base_url=f"{base}/v1",
                                                                                     api_key="-", max_retries=0))
        agent = agents.Agent(name="station", instructions="Answer from the documents; search first.", tools=[search],
                             model=model, model_settings=agents.ModelSettings(max_tokens=200))
        result = agents.Runner.run_sync(agent, "What is the passkey?", max_turns=4)
        prompt = backend.tokenizer.decode(backend.plan.token_ids.tolist())
    assert searched == ["passkey"]  # the SDK ran the tool with the model's arguments
    assert result.final_output == ANSWER
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert "search first" in prompt and '"passkey"' in prompt  # the instructions and the call, in the last step
