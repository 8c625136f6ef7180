"""Every vLLM worker rewrites positions before a plan is admitted: the check behind the proof.

The API-server process admits a plan and adds its proof to the answer, but positions are
rewritten in the worker processes. A worker without the runner patch (a Ray node without the
package, ``VLLM_PLUGINS`` differing between processes, a platform whose model runner the patch
does not cover) would prefill at contiguous positions under a valid proof. So:

- in every process where ``register()`` runs, vLLM's ``WorkerBase`` gains the method
  ``specprefill_runner_status``, which reports whether that worker's model runner class carries
  the rewrite (``runner.runner_patched``). A worker whose process never registered the plugin has
  no such method and fails the call;
- before it admits a plan, the API server asks every worker of every engine it talks to, through
  the engine client's ``collective_rpc`` (a method name: vLLM sends callables only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), and refuses plans with HTTP 503 while any worker
  reports no rewrite or the check fails. The verdict is cached per engine client (a positive one
  for ``CHECK_TTL_S``, a negative one for ``RETRY_S``), concurrent requests share one check;
- ``AsyncLLM.add_request`` applies the same verdict to every planned request of any endpoint
  (``admission`` calls it earlier for completions and chat, before a response starts).

Docs: docs/vllm.md, "Refusals".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..wire import NEXT_POSITION_KEY, POSITIONS_KEY
from .runner import MARK, runner_patched

__all__ = [
    "ASYNC_LLM_MODULE", "CHECK_TTL_S", "PATCHES", "RETRY_S", "RPC_TIMEOUT_S", "WORKER_BASE_MODULE", "WORKER_METHOD",
    "WorkerCheck", "has_plan", "refusal_of", "runner_status", "worker_refusal",
]

logger = logging.getLogger(__name__)

WORKER_BASE_MODULE = "vllm.v1.worker.worker_base"
ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"
WORKER_METHOD = "specprefill_runner_status"  # added to vLLM's WorkerBase by register()
CHECK_TTL_S = 30.0  # seconds a positive verdict is trusted before the workers are asked again
RETRY_S = 5.0  # seconds a negative verdict (or a failed check) stands before the next check
RPC_TIMEOUT_S = 30.0  # seconds the workers have to answer
_ATTR = "_specprefill_worker_check"  # the engine client's cached WorkerCheck
_FIX = ("Install specprefill-rag in the environment of every vLLM process (on every Ray node too), keep "
        "'specprefill' in VLLM_PLUGINS if it is set, and use a model runner the plugin patches (docs/vllm.md)")


def has_plan(extra: Any) -> bool:
    """Whether ``extra_args`` / ``vllm_xargs`` carry (part of) a SpecPrefill plan."""
    return isinstance(extra, dict) and (POSITIONS_KEY in extra or NEXT_POSITION_KEY in extra)


def runner_status(worker: Any) -> dict[str, Any]:
    """``WorkerBase.specprefill_runner_status``: runs inside a worker (``collective_rpc``)."""
    runner = getattr(worker, "model_runner", None)
    return {"patched": runner_patched(worker), "runner": type(runner).__name__}


def refusal_of(answers: list[Any]) -> str | None:
    """The refusal for the workers' answers to ``WORKER_METHOD`` (None: every worker rewrites)."""
    missing = [(rank, a) for rank, a in enumerate(answers) if not (isinstance(a, dict) and a.get("patched") is True)]
    if answers and not missing:
        return None
    runners = sorted({str(a.get("runner")) for _, a in missing if isinstance(a, dict)})
    return (f"SpecPrefill plans are refused by this vLLM server: the model runner of worker(s) "
            f"{[rank for rank, _ in missing] if answers else 'all'} of {len(answers)} "
            f"({', '.join(runners) or 'no runner'}) does not carry the specprefill position rewrite, so a "
            f"plan would be prefilled at contiguous positions. {_FIX}")


async def _ask_workers(client: Any) -> list[Any]:
    """Every worker's ``WORKER_METHOD`` answer, over all engines the client talks to."""
    core = getattr(client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    if callable(call_all):  # vLLM's AsyncMPClient: every data-parallel engine, not only the first
        per_engine = await call_all("collective_rpc", WORKER_METHOD, RPC_TIMEOUT_S, (), None)
        return [answer for answers in per_engine for answer in answers]
    return list(await client.collective_rpc(WORKER_METHOD, timeout=RPC_TIMEOUT_S))


class WorkerCheck:
    """One engine client's cached verdict on its workers (module docstring)."""

    def __init__(self, client: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self.checks = 0  # how often the workers were asked
        self._verdict: tuple[float, str | None] | None = None  # (valid until, refusal)
        self._running: asyncio.Future[str | None] | None = None

    async def refusal(self) -> str | None:
        """None when every worker reported the rewrite (recently); else why plans are refused."""
        verdict = self._verdict
        if verdict is not None and self.clock() < verdict[0]:
            return verdict[1]
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._check())
        return await asyncio.shield(self._running)  # a cancelled request does not cancel the check

    async def _check(self) -> str | None:
        self.checks += 1
        try:
            refusal = refusal_of(await asyncio.wait_for(_ask_workers(self.client), RPC_TIMEOUT_S + 5))
        except Exception as error:  # noqa: BLE001 - any failure to look means: not verified
            refusal = (f"SpecPrefill plans are refused by this vLLM server: it could not confirm that every vLLM "
                       f"worker carries the specprefill position rewrite ({type(error).__name__}: {error}); a "
                       f"worker process without the plugin has no '{WORKER_METHOD}' and fails this check. {_FIX}")
        self._verdict = (self.clock() + (CHECK_TTL_S if refusal is None else RETRY_S), refusal)
        if refusal is not None:
            logger.error("%s", refusal)
        return refusal


async def worker_refusal(client: Any) -> str | None:
    """Why this engine client's workers cannot honour plans now (None: they can); cached per client."""
    check = getattr(client, _ATTR, None)
    if check is None:
        check = WorkerCheck(client)
        try:
            setattr(client, _ATTR, check)
        except AttributeError:  # an object without a __dict__: checked every time
            pass
    return await check.refusal()


def _unavailable(message: str) -> Exception:
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    return GracefulHTTPError(message, HTTPStatus.SERVICE_UNAVAILABLE)


def _wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def add_request(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if has_plan(getattr(params, "extra_args", None)):
            refusal = await worker_refusal(self)
            if refusal is not None:
                raise _unavailable(refusal)
        return await original(self, request_id, prompt, params, *args, **kwargs)

    setattr(add_request, MARK, True)
    return add_request


def _patch_async_llm(module: ModuleType) -> None:
    cls = module.AsyncLLM
    original = cls.add_request
    if getattr(original, MARK, False):
        return
    params = list(inspect.signature(original).parameters)[:4]
    if params != ["self", "request_id", "prompt", "params"]:
        raise RuntimeError(f"specprefill-rag: AsyncLLM.add_request{tuple(params)} is not the shape this plugin was "
                           "written for (vLLM 0.32/0.33); refusing to patch")
    cls.add_request = _wrap_add_request(original)


def _specprefill_runner_status(self: Any) -> dict[str, Any]:
    return runner_status(self)


setattr(_specprefill_runner_status, MARK, True)


def _patch_worker_base(module: ModuleType) -> None:
    if not getattr(getattr(module.WorkerBase, WORKER_METHOD, None), MARK, False):
        setattr(module.WorkerBase, WORKER_METHOD, _specprefill_runner_status)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    WORKER_BASE_MODULE: _patch_worker_base,
    ASYNC_LLM_MODULE: _patch_async_llm,
}
