"""The gateway: an OpenAI-compatible endpoint a run serves while its agent environment's episodes run.

Where it lives: in the coordinator's process, one per run, started with the run's first batch of an agent
environment (``EnvFleet.runs_agent``) and closed with the run. Each completion is a turn of the agent loop's own
``TurnDispatcher`` (services/coordinator/agent/agent_loop.py): batched with the batch's other turns per rollout replica,
seeded from the episode's trajectory index, refused when sampled from weights older than the batch allows and
sampled again, on the same replica as the episode's last call while it serves the run. The gateway is a token
recorder, never a second inference server: one path to the rollouts, one set of weight versions.

HTTP (aiohttp): ``POST /v1/chat/completions`` and ``GET /v1/models``, bound to ``multi_turn.gateway.host``
(loopback by default) on ``port`` (0: one the system picks). Every request names its episode by the key it was
given (``Authorization: Bearer <key>``, OpenAI's API key): a key ``open`` handed out and ``close`` has not taken
back. Errors are OpenAI's error objects: 400 for a malformed body or field (``invalid_json``, the field in
``param``), ``n`` over ``max_n`` (``n_too_large``), a prompt over the run's budget (``context_length_exceeded``);
401 for a missing, unknown or ended key, or one of another run (``invalid_api_key``); 404 for another model
(``model_not_found``); 503 when the rollouts cannot serve it.

A completion is recorded (recorder.py) once its answer is written whole to the client: a call
whose client went away first (a stream it cut) is not recorded, so nothing the agent never saw trains, and a
client's retry of it is recorded once, as the call it is. A call still running when its episode ends is answered
401 and not recorded. A call's plan (what it extends), and a call's answer with its record, each hold the
episode's lock: a call sees every call of its episode answered before it recorded. A streamed call's chunks are
written once its completion is sampled (``Generate`` answers with whole completions).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from services.common.errors import Unavailable
from services.coordinator.agent.agent_loop import TURN_SEEDS, AgentTrace, Sampled, TurnDispatcher
from services.coordinator.fleet.clients import GatewayAccess
from services.coordinator.fleet.env_set import Episode
from services.coordinator.settings import AgentSettings
from services.coordinator.agent.turns import Trajectory, ids_text
from services.coordinator.agent.gateway.episodes import GatewayEpisode, agent_outcome, agent_samples, agent_trace
from services.coordinator.agent.gateway.recorder import Budget, EpisodeRecording
from services.coordinator.agent.gateway.wire import (ChatRequest, Choice, RequestError, assistant_message, chat_request,
                                               completion, error_body, models, stream_chunks)
from services.run.data import Prompt

log = structlog.get_logger()

MAX_BODY_BYTES = 16 << 20  # a request body past it is refused (413)
# A call whose body is under this is planned (its conversation rendered, tokenized) on the event loop: that takes
# well under a millisecond, less than a hop to a worker thread and back costs on a loaded machine (about 1 ms at a
# load of 8 on 2 cores, measured call by call); a larger one is planned in a worker thread, so that a long
# rendering never holds the loop (a 16,000-character one: 14 ms, the loop answering every 4 ms meanwhile).
PLAN_ON_LOOP_BYTES = 1024
KEY_PREFIX = "meshrl-episode"


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    host: str  # the address it binds
    port: int  # 0: one the system picks
    max_n: int  # completions one call may ask for
    budget: Budget


class Gateway:
    """A run's OpenAI-compatible endpoint (see the module's docstring)."""

    def __init__(self, *, run_id: str, tokenizer: Any, settings: GatewaySettings):
        self.run_id, self.model, self.tokenizer, self.settings = run_id, run_id, tokenizer, settings
        self.episodes: dict[str, GatewayEpisode] = {}
        self.not_recorded: Counter = Counter()  # why (client went away, episode ended) -> calls sampled, not recorded
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def started(self) -> bool:
        return self._runner is not None

    @property
    def connections(self) -> int:
        """HTTP connections open to it now."""
        return len(self._runner.server.connections) if self._runner is not None and self._runner.server else 0

    async def start(self) -> str:
        """Serve; the base URL an agent is given (http://host:port/v1)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[openai_errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.list_models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, self.settings.port)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
        log.info("gateway_serving", run_id=self.run_id, url=self.url)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for episode in self.episodes.values():
            episode.closed = True
        self.episodes.clear()

    def open(self, index: int, dispatcher: TurnDispatcher) -> GatewayAccess:
        """An episode for trajectory ``index`` of the batch ``dispatcher`` samples: its key, valid until
        ``close``."""
        key = f"{KEY_PREFIX}-{self.run_id}-{secrets.token_urlsafe(24)}"
        self.episodes[key] = GatewayEpisode(key=key, index=index, dispatcher=dispatcher,
                                            recording=EpisodeRecording(budget=self.settings.budget))
        return GatewayAccess(url=self.url, key=key, model=self.model)

    def close_episode(self, key: str) -> GatewayEpisode:
        """End the episode of ``key`` (its key no longer valid) and give back what it recorded."""
        episode = self.episodes.pop(key)
        episode.closed = True
        return episode

    async def trajectory(self, access: GatewayAccess, prompt: Prompt,
                         episode: Episode) -> tuple[tuple[Trajectory, ...], AgentTrace]:
        """The agent's run in ``episode``, opened with ``access``: its samples and trace
        (services/coordinator/agent/gateway/episodes.py)."""
        try:
            step = await episode.step("")  # the agent runs to its end
        finally:
            recorded = self.close_episode(access.key)
        outcome = agent_outcome(step, recorded.recording.calls)
        if outcome != "ok":
            log.warning("agent_failed", run_id=self.run_id, episode=recorded.index, outcome=outcome,
                        error=str(step.info.get("agent_error") or step.info.get("error") or "")[:2000])
        samples = agent_samples(recorded, self.tokenizer, prompt,
                                max_prompt_length=self.settings.budget.max_prompt_length)
        return samples, agent_trace(recorded, step, outcome, episode=episode, tokenizer=self.tokenizer)

    def forget(self, key: str) -> None:
        """End the episode of ``key`` if it is open, what it recorded dropped (its env replica failed)."""
        if key in self.episodes:
            self.close_episode(key)

    def _episode(self, request: web.Request) -> GatewayEpisode:
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        episode = self.episodes.get(key)
        if episode is not None:
            return episode
        if not key:
            raise RequestError(401, "no API key: send the episode's key as the bearer token (OPENAI_API_KEY)",
                               code="invalid_api_key")
        owner = key[len(KEY_PREFIX) + 1:].rsplit("-", 1)[0] if key.startswith(KEY_PREFIX + "-") else ""
        if owner and owner != self.run_id:
            raise RequestError(401, f"this key is an episode key of run {owner}; this endpoint serves run "
                                    f"{self.run_id}", code="invalid_api_key")
        raise RequestError(401, "unknown API key, or its episode has ended", code="invalid_api_key")

    async def list_models(self, request: web.Request) -> web.Response:
        self._episode(request)
        return web.json_response(models(self.model))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        raw = await request.read()
        body = chat_request(raw, self.settings.max_n)
        if body.model != self.model:
            raise RequestError(404, f"the model {body.model!r} does not exist here; this endpoint serves "
                                    f"{self.model!r} (GET /v1/models)", code="model_not_found", param="model")
        recording = episode.recording
        tools = body.tools if body.tool_choice.offered else ()
        planned = partial(recording.plan, self.tokenizer, body.messages, tools, opening=body.tool_choice.opening)
        async with episode.recording_lock:  # the plan sees every call of the episode answered before it, recorded
            plan = planned() if len(raw) < PLAN_ON_LOOP_BYTES else await asyncio.to_thread(planned)
        room = plan.room
        if body.n > TURN_SEEDS - episode.seeds_used:
            raise RequestError(400, f"the episode has used its {TURN_SEEDS} completions", code="n_too_large",
                               param="n")
        first_seed = episode.index * TURN_SEEDS + episode.seeds_used
        episode.seeds_used += body.n
        prompt_ids = plan.prompt_ids
        sampled = await self._sample(episode, prompt_ids, body, max_tokens=min(body.max_tokens or room, room),
                                     first_seed=first_seed)
        choices = self._decode(sampled, body)  # microseconds: the completion's ids, decoded once
        tool_names = frozenset(str(t["function"]["name"]) for t in body.tools)
        unique = uuid.uuid4().hex  # the completion's id, and its tool calls' ids (call_<16 of it>_<choice>_<call>)
        messages = [assistant_message(body.tool_choice.opening + choice.text, tool_names=tool_names,
                                      parse_tools=body.tool_choice.offered, call_id=f"call_{unique[:16]}_{j}")
                    for j, choice in enumerate(choices)]
        completion_id = f"chatcmpl-{unique}"
        if episode.closed:
            raise RequestError(401, "the episode ended while this call ran", code="invalid_api_key")
        async with episode.recording_lock:  # answered and recorded before another call of the episode plans
            response, delivered = await respond(request, body, completion_id=completion_id, model=self.model,
                                                messages=messages, choices=choices, prompt_ids=prompt_ids)
            if not delivered or episode.closed:
                why = "episode ended" if delivered else "client went away"
                self.not_recorded[why] += 1
                log.info("gateway_call_not_recorded", run_id=self.run_id, episode=episode.index, why=why)
                return response
            kept = [s.tokens._replace(ids=c.token_ids, logprobs=c.logprobs) for s, c in zip(sampled, choices)]
            recording.record(plan, [(tokens, s.last_version) for tokens, s in zip(kept, sampled)], self.tokenizer,
                             returned=messages)
        episode.rollouts.extend(s.replica.address for s in sampled)
        return response

    async def _sample(self, episode: GatewayEpisode, prompt_ids: tuple[int, ...], body: ChatRequest, *,
                      max_tokens: int, first_seed: int) -> list[Sampled]:
        """``body.n`` completions of ``prompt_ids`` through the episode's dispatcher; 503 if the rollouts fail."""
        dispatcher = episode.dispatcher
        sampling = None  # the batch's, shared with the other turns it may join
        if body.temperature is not None or body.top_p is not None:
            own = dispatcher.sampling
            sampling = replace(own, temperature=own.temperature if body.temperature is None else body.temperature,
                               top_p=own.top_p if body.top_p is None else body.top_p)
        turns = [dispatcher.sample(prompt_ids, max_tokens, first_seed + j, prefer=episode.replica, sampling=sampling)
                 for j in range(body.n)]
        try:  # a lone completion awaited as it is (no task to start, no gathering to wait for)
            sampled = await asyncio.gather(*turns) if len(turns) > 1 else [await turns[0]]
        except Unavailable as error:
            raise RequestError(503, f"the rollouts could not sample this call: {error}", kind="server_error",
                               code="rollouts_unavailable") from None
        episode.replica = sampled[0].replica
        return list(sampled)

    def _decode(self, sampled: list[Sampled], body: ChatRequest) -> list[Choice]:
        return [decode_choice(self.tokenizer, s.tokens.ids, s.tokens.logprobs, truncated=s.truncated, stop=body.stop,
                              token_texts=body.logprobs) for s in sampled]


def run_gateway(run_id: str, settings: AgentSettings, tokenizer: Any) -> Gateway:
    """The gateway of a multi-turn run (not serving until its first batch of an agent environment)."""
    return Gateway(run_id=run_id, tokenizer=tokenizer, settings=GatewaySettings(
        host=settings.gateway_host, port=settings.gateway_port, max_n=settings.gateway_max_n,
        budget=Budget(max_prompt_length=settings.max_prompt_length, max_response_length=settings.max_response_length)))


def decode_choice(tokenizer: Any, ids: tuple[int, ...], logprobs: tuple[float, ...], *, truncated: bool,
                  stop: tuple[str, ...], token_texts: bool = True) -> Choice:
    """A completion decoded; where it holds a stop string, its ids cut after the token that completes the first
    one and its text before it (the tokens past it are not returned and do not train). ``token_texts``: each
    token's text too (the logprobs' ``token``; empty otherwise)."""
    text = ids_text(tokenizer, ids, skip_special_tokens=True)
    found = [(text.find(s), s) for s in stop if s in text]
    if found:
        at, string = min(found)
        kept = first_prefix_holding(tokenizer, ids, at + len(string))
        ids, logprobs, text, reason = ids[:kept], logprobs[:kept], text[:at], "stop"
    else:
        reason = "length" if truncated else "stop"
    tokens = tuple(ids_text(tokenizer, [i], skip_special_tokens=False) for i in ids) if token_texts else ()
    return Choice(text=text, token_ids=tuple(ids), tokens=tokens, logprobs=tuple(logprobs), finish_reason=reason)


def first_prefix_holding(tokenizer: Any, ids: tuple[int, ...], characters: int) -> int:
    """The fewest of ``ids`` whose decoded text has at least ``characters`` characters (binary search: the decoded
    length grows with the ids)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(ids_text(tokenizer, ids[:middle], skip_special_tokens=True)) >= characters:
            high = middle
        else:
            low = middle + 1
    return high


async def respond(request: web.Request, body: ChatRequest, *, completion_id: str, model: str, messages: list[dict],
                  choices: list[Choice], prompt_ids: tuple[int, ...]) -> tuple[web.StreamResponse, bool]:
    """Write the answer (a JSON object, or server-sent chunks): the response, and whether it was written whole
    (False: the client went away first)."""
    response: web.StreamResponse
    if not body.stream:
        answer = completion(completion_id=completion_id, model=model, messages=messages, choices=choices,
                            prompt_ids=prompt_ids, logprobs=body.logprobs, return_token_ids=body.return_token_ids)
        response = web.Response(text=json.dumps(answer), content_type="application/json")
    else:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        if body.stream:
            for chunk in stream_chunks(completion_id=completion_id, model=model, messages=messages, choices=choices,
                                       prompt_ids=prompt_ids, logprobs=body.logprobs,
                                       include_usage=body.include_usage):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        return response, False
    return response, True


@web.middleware
async def openai_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every refusal as OpenAI's error object."""
    try:
        return await handler(request)
    except RequestError as error:
        return web.json_response(error.body(), status=error.status)
    except web.HTTPException as error:
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(error.status)
        return web.json_response(error_body(f"{error.reason}: {request.method} {request.path}",
                                            kind="invalid_request_error", code=code), status=error.status)
    except Exception as error:  # logged, answered as OpenAI's server_error
        log.exception("gateway_error", path=request.path)
        return web.json_response(error_body(f"{type(error).__name__}: {error}", kind="server_error"), status=500)
