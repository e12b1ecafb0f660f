"""The framework imitations' HTTP clients, shared by the wire-imitation tests (tests/compat/frameworks/test_*_client.py,
against simulated engines) and the end-to-end suite (tests/e2e/test_frameworks_*.py, against real engines).

Each class makes, on the wire, the calls one framework makes, in its order; the sources each follows are named in
the docstring of its framework's test module (test_skyrl_client.py, test_prime_rl_client.py, test_slime_client.py,
test_nemo_rl_client.py) and in docs/frameworks/. They are plain HTTP clients: nothing here reads a simulator.
The model name and the frameworks' own waits are arguments (the wire tests run the simulator on a fast clock;
the defaults are the frameworks' own, in real seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson
from openai import AsyncOpenAI

SIM_MODEL = "sim-model"  # the simulator's served model name
PRIME_RL_API_KEY = "prime-key"  # $VLLM_API_KEY, prime-rl's `api_key_var` default

# ---- SkyRL ---------------------------------------------------------------------------------------------------


class SkyRLClient:
    """`RemoteInferenceClient`'s data plane as it goes over the wire (module docstring)."""

    def __init__(self, proxy_url: str, model: str = SIM_MODEL) -> None:
        self.proxy_url = proxy_url
        self.model = model
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self.finished: list[tuple[str, int]] = []  # (session id, HTTP status) per finish_session call
        self.loops: list[asyncio.Task[None]] = []  # the agent loops it serves, ended before it closes

    async def close(self) -> None:
        for task in self.loops:
            task.cancel()
        await asyncio.gather(*self.loops, return_exceptions=True)
        await self.session.close()

    async def _post(self, url: str, json: dict[str, Any], headers: dict[str, str]) -> tuple[Any, str]:
        async with self.session.post(url, json=json, headers=headers) as resp:
            body = orjson.loads(await resp.read())
            assert resp.status < 400, body
            return body, resp.headers["X-Rolloutgate-Engine"]

    async def _routed(self, path: str, request_payload: dict[str, Any]) -> tuple[Any, str]:
        body = dict(request_payload["json"])
        session_id = body.pop("session_id", None)
        body["model"] = body.get("model") or self.model
        headers = {"Content-Type": "application/json"}
        if session_id:
            headers["X-Session-ID"] = str(session_id)
        return await self._post(f"{self.proxy_url}{path}", body, headers)

    async def generate_single(
        self, prompt_token_ids: list[int], sampling_params: dict[str, Any], session_id: str | None
    ) -> tuple[dict[str, Any], str]:
        """`_generate_single`: its payload, its headers, what it reads of the answer."""
        payload = {"sampling_params": sampling_params, "model": self.model, "token_ids": prompt_token_ids}
        headers = {"Content-Type": "application/json"}
        if session_id:
            headers["X-Session-ID"] = str(session_id)
        response, engine = await self._post(f"{self.proxy_url}/inference/v1/generate", payload, headers)
        choice = response["choices"][0]
        logprobs = choice.get("logprobs")
        content = logprobs.get("content", []) if logprobs is not None else []
        result = {
            "stop_reason": choice["finish_reason"],
            "response_ids": choice["token_ids"],
            "response_logprobs": [info["logprob"] for info in content] if content else None,
        }
        return result, engine

    async def completion(self, request_payload: dict[str, Any]) -> tuple[Any, str]:
        return await self._routed("/v1/completions", request_payload)

    async def chat_completion(self, request_payload: dict[str, Any]) -> tuple[Any, str]:
        return await self._routed("/v1/chat/completions", request_payload)

    async def finish_session(self, session_id: str) -> None:
        if not session_id:
            return
        async with self.session.post(
            f"{self.proxy_url}/finish_session",
            params={"session_id": str(session_id)},
            timeout=aiohttp.ClientTimeout(total=10.0),
        ) as resp:
            await resp.read()
            self.finished.append((session_id, resp.status))


class Trajectory:
    """`SkyRLGymGenerator.agent_loop`'s shape: one session for all its turns, released in `finally`. The test
    hands it its turns one at a time (their `max_tokens`; None ends it) to order the trajectories' phases."""

    OBS_IDS = [13, 29, 7]  # the environment's observation, appended after each output

    def __init__(self, client: SkyRLClient, instance_id: int, repetition_id: int = 0) -> None:
        self.client = client
        self.session_id = f"{instance_id}_{repetition_id}"
        self.prompt_ids = [1, 100 + instance_id, *range(2, 40)]
        self.engines: list[str] = []
        self.calls: list[tuple[str, int]] = []  # (the engine that answered, tokens asked) per turn
        self._steps: asyncio.Queue[tuple[int | None, asyncio.Future[None]]] = asyncio.Queue()
        self.task = asyncio.create_task(self.agent_loop())
        client.loops.append(self.task)

    async def agent_loop(self) -> None:
        try:
            while True:
                max_tokens, done = await self._steps.get()
                if max_tokens is None:
                    done.set_result(None)
                    return
                params = {"max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0}
                result, engine = await self.client.generate_single(self.prompt_ids, params, self.session_id)
                assert len(result["response_ids"]) == max_tokens == len(result["response_logprobs"])
                self.engines.append(engine)
                self.calls.append((engine, max_tokens))
                self.prompt_ids = self.prompt_ids + result["response_ids"] + self.OBS_IDS
                done.set_result(None)
        finally:
            await self.client.finish_session(self.session_id)

    def start_turn(self, max_tokens: int | None) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._steps.put_nowait((max_tokens, done))
        return done

    async def turn(self, max_tokens: int = 8) -> None:
        await self.start_turn(max_tokens)

    async def end(self) -> None:
        await self.start_turn(None)
        await self.task


# ---- prime-rl ------------------------------------------------------------------------------------------------


class PrimeRLClients:
    """The orchestrator's data plane (an OpenAI client on `base_url`) and its session client (module docstring)."""

    def __init__(self, base_url: str, model: str = SIM_MODEL, api_key: str = PRIME_RL_API_KEY) -> None:
        self.model = model
        self.openai = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=10, timeout=3600.0)
        router = base_url.rstrip("/").removesuffix("/v1")
        self.session_client = httpx.AsyncClient(
            base_url=router, headers={"Authorization": f"Bearer {api_key}"}, timeout=httpx.Timeout(None)
        )
        # the renderer client's token calls: the same router, the same key (`Authorization: Bearer`)
        self.renderer = httpx.AsyncClient(
            base_url=router, headers={"Authorization": f"Bearer {api_key}"}, timeout=httpx.Timeout(3600.0)
        )
        self.released: list[tuple[str, int]] = []  # (session id, HTTP status) per /finish_session

    async def close(self) -> None:
        await self.openai.close()
        await self.session_client.aclose()
        await self.renderer.aclose()

    async def wait_for_ready(self) -> None:
        response = await self.session_client.get("/health")
        response.raise_for_status()

    async def finish_sessions(self, session_ids: list[str]) -> None:
        async def finish_session(session_id: str) -> None:
            response = await self.session_client.post(
                "/finish_session",
                timeout=httpx.Timeout(connect=10.0, read=5.0, write=60.0, pool=10.0),
                params={"session_id": session_id},
            )
            self.released.append((session_id, response.status_code))
            with contextlib.suppress(httpx.HTTPStatusError):  # logged at debug level, never raised
                response.raise_for_status()

        if session_ids:
            await asyncio.gather(*(finish_session(session_id) for session_id in session_ids))


class Episode:
    """One rollout: its traces (one session each, `X-Session-ID: <trace id>` on every call), run as the
    dispatcher's episode task runs it: its turns, then `finish_sessions(sorted(trace ids))` in `finally`."""

    TOOL_OUTPUT_IDS = [13, 29, 7]  # a token turn's environment reply, appended after each output

    def __init__(self, clients: PrimeRLClients, trace_ids: list[str], *, tokens: bool = False) -> None:
        """`tokens`: a training rollout (the renderer client's token calls); else chat calls (eval)."""
        self.clients = clients
        self.trace_ids = trace_ids
        self.tokens = tokens
        self.engines: dict[str, list[str]] = {trace: [] for trace in trace_ids}
        self.calls: list[tuple[str, int]] = []  # (the engine that answered, tokens asked) per call
        self.messages: dict[str, list[Any]] = {
            t: [{"role": "user", "content": f"task {t}"}] for t in trace_ids
        }
        self.token_ids: dict[str, list[int]] = {
            t: [1, 200 + n, *range(2, 40)] for n, t in enumerate(trace_ids)
        }

    async def turn(self, trace_id: str, max_tokens: int = 6) -> None:
        raw = await self.clients.openai.chat.completions.with_raw_response.create(
            model=self.clients.model,
            messages=self.messages[trace_id],
            max_tokens=max_tokens,
            logprobs=True,
            extra_headers={"X-Session-ID": trace_id},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        completion = raw.parse()
        self.engines[trace_id].append(raw.headers["X-Rolloutgate-Engine"])
        self.calls.append((raw.headers["X-Rolloutgate-Engine"], max_tokens))
        reply = completion.choices[0].message
        self.messages[trace_id] = [
            *self.messages[trace_id],
            {"role": "assistant", "content": reply.content or ""},
            {"role": "user", "content": "tool output"},
        ]

    async def token_turn(self, trace_id: str, max_tokens: int = 6) -> None:
        """The renderer client's call: the trace's token ids to vLLM's `/inference/v1/generate`, with the key
        and the session header; the output ids and the environment's reply extend the next turn's prompt."""
        body = {
            "model": self.clients.model,
            "token_ids": self.token_ids[trace_id],
            "sampling_params": {"max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True},
        }
        response = await self.clients.renderer.post(
            "/inference/v1/generate", json=body, headers={"X-Session-ID": trace_id}
        )
        response.raise_for_status()
        (choice,) = response.json()["choices"]
        assert len(choice["token_ids"]) == max_tokens == len(choice["logprobs"]["content"]), choice
        engine = response.headers["X-Rolloutgate-Engine"]
        self.engines[trace_id].append(engine)
        self.calls.append((engine, max_tokens))
        self.token_ids[trace_id] = [*self.token_ids[trace_id], *choice["token_ids"], *self.TOOL_OUTPUT_IDS]

    async def run(self, turns: int, *, fail_after: int | None = None, last_turn_tokens: int = 6) -> None:
        try:
            for n in range(turns):
                if fail_after is not None and n == fail_after:
                    raise RuntimeError("env exploded")  # the env server's error: a DispatchFailure
                tokens = last_turn_tokens if n == turns - 1 else 6
                turn = self.token_turn if self.tokens else self.turn
                await asyncio.gather(*(turn(trace, tokens) for trace in self.trace_ids))
        finally:
            await asyncio.shield(self.clients.finish_sessions(sorted(self.trace_ids)))

    def engine(self, trace_id: str) -> str:
        (engine,) = set(self.engines[trace_id])  # every call of a trace on one engine
        return engine


# ---- slime ---------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """The fields of slime's `Sample` that its rollout reads and writes."""

    prompt_ids: list[int]
    session_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    log_probs: list[float] = field(default_factory=list)
    response: str = ""
    status: str = "pending"
    weight_versions: list[str] = field(default_factory=list)

    def append_response_tokens(
        self, tokens: list[int], log_probs: list[float], meta: dict[str, Any], text: str
    ) -> None:
        assert len(log_probs) == len(tokens)
        self.response += text
        self.tokens += tokens
        self.response_length += len(tokens)
        self.log_probs += log_probs
        if "finish_reason" not in meta:
            return
        if "weight_version" in meta:
            self.weight_versions.append(meta["weight_version"])
        self.status = {"length": "truncated", "abort": "aborted", "stop": "completed"}[
            meta["finish_reason"]["type"]
        ]


def slime_sampling_params(max_new_tokens: int) -> dict[str, Any]:
    """`GenerateState.sampling_params` with slime's defaults (`--rollout-temperature 1` ... `--rollout-top-k -1`)."""
    return {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


class Slime:
    """slime's HTTP side: its engines' registration and removal, its rollout, its step-end abort."""

    def __init__(
        self,
        router_url: str,
        engines: int,
        *,
        consistent_hashing: bool = False,
        post_retry_interval_s: float = 1.0,  # http_utils._post's sleep between tries
        abort_retry_interval_s: float = 3.0,  # server_control.ABORT_RETRY_INTERVAL_SECONDS
    ) -> None:
        self.router_url = router_url
        self.post_retry_interval_s = post_retry_interval_s
        self.abort_retry_interval_s = abort_retry_interval_s
        self.consistent_hashing = consistent_hashing
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=512 * engines), timeout=httpx.Timeout(None), trust_env=False
        )
        self.retries = 0  # slime's `_post` retries any error; none is expected here
        # added to every call's sampling parameters (a test's own, which says why)
        self.extra_sampling_params: dict[str, Any] = {}
        self.pendings: set[asyncio.Task[Sample]] = set()

    async def close(self) -> None:
        for task in self.pendings:
            task.cancel()
        await asyncio.gather(*self.pendings, return_exceptions=True)
        await self.client.aclose()

    async def post(self, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        for attempt in range(60):
            try:
                response = await self.client.post(url, json=payload or {}, headers=headers)
                response.raise_for_status()
                return json.loads(response.content) if response.content.strip() else ""
            except (httpx.HTTPError, ValueError):
                self.retries += 1
                if attempt == 59:
                    raise
                await asyncio.sleep(self.post_retry_interval_s)
        raise AssertionError("unreachable")

    async def get(self, url: str) -> Any:
        response = await self.client.get(url)
        response.raise_for_status()
        return json.loads(response.content)

    # -- SGLangEngine
    async def register(self, engine_url: str) -> int:
        response = await self.client.post(
            f"{self.router_url}/workers", json={"url": engine_url, "worker_type": "regular"}
        )
        response.raise_for_status()
        return response.status_code

    async def unregister(self, engine_url: str) -> int:
        workers = (await self.client.get(f"{self.router_url}/workers")).json()["workers"]
        (worker,) = [w for w in workers if w["url"] == engine_url]
        response = await self.client.delete(f"{self.router_url}/workers/{worker['id']}")
        response.raise_for_status()
        return response.status_code

    # -- sglang_rollout
    async def generate(self, sample: Sample, max_new_tokens: int) -> Sample:
        params = {
            **slime_sampling_params(max_new_tokens - sample.response_length),
            **self.extra_sampling_params,
        }
        payload = {
            "sampling_params": params,
            "return_logprob": True,
            "input_ids": sample.tokens or sample.prompt_ids,
        }
        if not sample.tokens:
            sample.tokens = list(sample.prompt_ids)
        headers = {"X-SMG-Routing-Key": sample.session_id} if self.consistent_hashing else None
        output = await self.post(f"{self.router_url}/generate", payload, headers=headers)
        triples = output["meta_info"].get("output_token_logprobs", [])
        sample.append_response_tokens(
            [t[1] for t in triples], [t[0] for t in triples], output["meta_info"], output["text"]
        )
        return sample

    def submit(self, samples: list[Sample], max_new_tokens: int) -> None:
        for sample in samples:
            self.pendings.add(asyncio.create_task(self.generate(sample, max_new_tokens)))

    async def abort_server_until_idle(self, url: str) -> int:
        """server_control's loop, bounded here; the number of abort rounds it took."""
        for attempt in range(1, 21):
            await self.post(f"{url}/abort_request", {"abort_all": True})
            load = await self.get(f"{url}/v1/loads?include=core")
            if sum(s["num_running_reqs"] + s["num_waiting_reqs"] for s in load["loads"]) <= 0:
                return attempt
            await asyncio.sleep(self.abort_retry_interval_s)
        raise AssertionError(f"{url} never idle")

    async def abort(self, *, router_first: bool = False) -> list[Sample]:
        """sglang_rollout.abort; `router_first`: with the patch of docs/frameworks/slime.md."""
        response = await self.get(f"{self.router_url}/workers")
        urls = [worker["url"] for worker in response["workers"]]
        if router_first:
            await self.post(f"{self.router_url}/abort_request", {"abort_all": True})
        rounds = await asyncio.gather(*(self.abort_server_until_idle(url) for url in urls))
        assert all(r >= 1 for r in rounds)
        aborted = []
        while self.pendings:
            done, self.pendings = await asyncio.wait(self.pendings, return_when=asyncio.FIRST_COMPLETED)
            aborted += [task.result() for task in done]
        return aborted


# ---- NeMo RL -------------------------------------------------------------------------------------------------


def nemo_sampling_params(max_new_tokens: int) -> dict[str, Any]:
    """`_build_sampling_params` for a sampled (not greedy) batch with NeMo RL's defaults (top_k unset)."""
    return {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": max_new_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


class NemoRL:
    """NeMo RL's SGLang backend on the wire: its workers' registration, its batch generation, its refit."""

    def __init__(self, router_url: str, *, time_scale: float = 1.0) -> None:
        """`time_scale`: engine seconds per real second; NeMo RL's own waits (1 s between tries, 2 s between
        health checks, 0.5 s between registration checks) are divided by it."""
        self.router_url = router_url
        self.time_scale = time_scale
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None))
        self.retries = 0
        # added to every call's sampling parameters (a test's own, which says why)
        self.extra_sampling_params: dict[str, Any] = {}
        self.served_by: list[str] = []  # rolloutgate's `X-Rolloutgate-Engine` per answer (NeMo RL ignores it)

    async def close(self) -> None:
        await self.client.aclose()

    async def post(self, url: str, payload: dict[str, Any]) -> Any:
        """`HttpClient.post`: 3 tries, 1 s apart (on `time_scale`), on any error."""
        for attempt in range(3):
            try:
                response = await self.client.post(url, json=payload or {})
                response.raise_for_status()
                self.served_by.append(
                    response.headers.get("X-Rolloutgate-Engine", "")
                )  # absent after keep-alive
                return response.json()
            except (httpx.HTTPError, ValueError):
                self.retries += 1
                if attempt == 2:
                    raise
                await asyncio.sleep(1 / self.time_scale)
        raise AssertionError("unreachable")

    # -- SGLangGenerationWorker
    async def launch_and_register(self, engine_url: str) -> int:
        for path in ("/health_generate", "/flush_cache"):  # _wait_server_healthy, bounded here
            for _ in range(100):
                if (await self.client.get(f"{engine_url}{path}")).status_code == 200:
                    break
                await asyncio.sleep(2 / self.time_scale)
            else:
                raise AssertionError(f"{engine_url}{path} never 200")
        response = await self.client.post(
            f"{self.router_url}/workers", json={"url": engine_url, "worker_type": "regular"}
        )
        response.raise_for_status()
        for _ in range(60):  # _wait_for_router_registration: 30 s at 0.5 s
            listed = await self.client.get(f"{self.router_url}/workers", timeout=5)
            listed.raise_for_status()
            if any(w.get("url") == engine_url for w in listed.json().get("workers", [])):
                return response.status_code
            await asyncio.sleep(0.5 / self.time_scale)
        raise RuntimeError(f"Timed out waiting for worker {engine_url} to appear in router")

    async def shutdown(self, engine_url: str) -> int:
        workers = (await self.client.get(f"{self.router_url}/workers")).json()["workers"]
        (worker,) = [w for w in workers if w["url"] == engine_url]
        response = await self.client.delete(f"{self.router_url}/workers/{worker['id']}")
        response.raise_for_status()
        return response.status_code

    # -- SGLangGeneration
    async def generate_one_sample(
        self, input_ids: list[int], max_new_tokens: int
    ) -> tuple[list[int], list[float], bool]:
        payload = {
            "sampling_params": {**nemo_sampling_params(max_new_tokens), **self.extra_sampling_params},
            "return_logprob": True,
            "input_ids": input_ids,
        }
        output = await self.post(f"{self.router_url}/generate", payload)
        triples = output["meta_info"].get("output_token_logprobs", [])
        finish_reason = output["meta_info"].get("finish_reason") or {}
        return [t[1] for t in triples], [t[0] for t in triples], finish_reason.get("type") == "length"

    async def generate(
        self, batch: list[list[int]], max_new_tokens: int
    ) -> list[tuple[list[int], list[float], bool]]:
        semaphore = asyncio.Semaphore(1024)

        async def bounded(ids: list[int]) -> tuple[list[int], list[float], bool]:
            async with semaphore:
                return await self.generate_one_sample(ids, max_new_tokens)

        return list(await asyncio.gather(*(bounded(ids) for ids in batch)))

    # -- SGLangWeightSynchronizer._refit (#3612), on every engine directly
    async def pause(self, engine_urls: list[str], mode: str) -> None:
        for url in engine_urls:
            (await self.client.post(f"{url}/pause_generation", json={"mode": mode})).raise_for_status()

    async def flush(self, engine_urls: list[str]) -> list[int]:
        """`invalidate_kv_cache`: `GET /flush_cache` on each engine; its statuses (`_refit` raises on a non-200)."""
        return [(await self.client.get(f"{url}/flush_cache")).status_code for url in engine_urls]

    async def transfer(self, engine_urls: list[str], version: str) -> None:
        for url in engine_urls:
            updated = await self.client.post(
                f"{url}/update_weights_from_disk", json={"model_path": f"/ckpt/{version}"}
            )
            updated.raise_for_status()

    async def resume(self, engine_urls: list[str]) -> None:
        for url in engine_urls:
            (await self.client.post(f"{url}/continue_generation", json={})).raise_for_status()
