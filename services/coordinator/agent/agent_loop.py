"""The agent loop: each prompt's samples as multi-turn trajectories, the model's turns on the rollouts and the
tools' or environment's replies from the env services.

Choices:
- Each trajectory is its own task: open an episode on an env replica, render the prompt (with the episode's
  opening messages and the environment's tool schemas) once, then turn by turn: sample the model's turn, hand
  its text to the episode, append the reply's ids (``turns.render_reply``: token-exact, never re-tokenizing
  the history), until the environment says done, the model answers without a tool call, a turn limit is
  reached or ``data.max_response_length`` is used up. Every trajectory of a batch runs at once; a long one
  holds no other.
- Turns are sampled through ``TurnDispatcher``: the turns waiting for a replica go to it as one Generate call
  (one prompt each, n = 1, each seeded from its trajectory and turn index, so a trajectory samples the same
  whichever replica or call its turns land in); a later turn goes to the replica of the turn before it while
  that one serves the run (its prefix cache holds the conversation). A replica's first waiting turn waits up to
  ``GATHER_S`` for others to join its call, less where nobody can: once every trajectory still running has a
  turn waiting or being sampled, the call goes (a lone trajectory's turn, a lone gateway episode's call, goes at
  once). An hf engine runs one call at a time, so each replica gets one call in flight (the turns that become
  ready meanwhile make the next); a vLLM engine batches inside, so its calls go at once. A call that fails is
  sent again to another replica, from the same prefix; one sampled from weights older than the batch allows is
  sampled again.
- A trajectory whose env replica fails (killed, unreachable) starts again from its prompt on another, counted
  (``agent/episodes_restarted``): the episode's state is lost with the replica, so its turns would not follow.
- A trajectory whose episode an env replica refuses because every worker is busy (other runs share the service)
  waits and asks again (``EnvSet.episode``), counted (``agent/env_busy_waits``).
- Where the template cannot extend the conversation exactly (``CannotExtend``: it strips earlier thinking, for
  example), the trajectory's sample is closed as it stands (its model tokens train) and the trajectory goes on,
  in the same episode, in a new sample whose prompt is the whole conversation so far rendered fresh
  (``turns.next_sample``), counted (``agent/new_samples``), as prime-rl's interleaved rollouts start a new
  training sample where the extension property breaks. The limits are the trajectory's, over its samples:
  ``max_assistant_turns`` and ``max_user_turns`` count every turn, and its response tokens together fit
  ``data.max_response_length``. A reply that does not fit what is left ends the trajectory (``OverBudget``).
- The trajectory's score is the reward service's score of the model's final turn plus ``env_reward_weight``
  times the environment's step rewards (``Rollouts.env_scores``); each of its samples is trained with it
  (``Rollouts``: the advantages are the trajectory's).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from services.common.errors import Unavailable
from services.common.rpc import is_retryable
from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import EnvStep, GatewayAccess, RolloutClient
from services.coordinator.fleet.env_set import EnvFleet, EnvLost, EnvSet, Episode
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.settings import AgentSettings, Sampling
from services.coordinator.agent.turns import (CannotExtend, Message, OverBudget, SampledTokens, Trajectory, extend,
                                        next_sample, render_prompt, render_reply)
from services.coordinator.waiting import Notices
from services.run.data import Prompt

TURN_SEEDS = 1 << 12  # seed indices each trajectory reserves: turn t of trajectory k is seeded k * TURN_SEEDS + t
EPISODE_ATTEMPTS = 3  # a trajectory started again after its env replica failed, before the batch fails
TURN_ATTEMPTS = 4  # a turn sent again after its Generate call failed, before the batch fails
GATHER_S = 0.005  # how long a replica's first waiting turn waits for others to join its call (at most: the wait
# ends once every trajectory still running has a turn waiting or being sampled)
MAX_TURNS_PER_CALL = 256


@dataclass(frozen=True, kw_only=True)
class TurnRecord:
    """One turn of a trajectory, as the samples file shows it."""

    role: str  # model, or reply (a tool's or the environment's message)
    text: str
    tokens: int
    trained: bool
    weight_version: int | None  # model turns: the weights that sampled it
    tool: str  # replies: the tool that answered ("" for an environment's message)
    seconds: float  # model turns: sampling it; replies: the environment's step
    sample: int = 0  # the trajectory's sample it is in (0: the first; a reply that opens a later one has 0 tokens:
    # it is in that sample's prompt, rendered fresh)


@dataclass(frozen=True, kw_only=True)
class AgentTrace:
    """What one trajectory did, beside its tokens: for the lineage, the samples file and the metrics."""

    turns: tuple[TurnRecord, ...]
    final_text: str  # the model's last turn, decoded: what the reward service scores
    env_reward: float  # the environment's step rewards, summed
    episode_service: str  # the env replica that ran the episode (id and version)
    rollouts: tuple[str, ...]  # the rollout replicas that sampled its turns, in order
    last_versions: tuple[int, ...]  # each of its samples': the weights that sampled its last model token
    ended: Ended
    tool_calls: Counter  # tool name -> calls
    tool_errors: Counter  # tool name -> calls that answered an error
    tool_timeouts: Counter  # tool name -> calls that timed out
    env_seconds: float
    restarts: int  # times its episode was started again on another replica
    env_busy_waits: int = 0  # Resets of its episodes refused because every worker of the env replica was busy
    agent_outcome: str = ""  # an agent environment's (agent/gateway/episodes.py): ok, no_calls, raised, timed_out
    agent_score: float | None = None  # the score its agent decided (None: the reward service's)
    gateway_calls: int = 0  # completions its agent's calls to the gateway recorded
    gateway_segments: int = 0  # of those calls, the ones that started a new sample (the first included)


class Ended(StrEnum):
    """Why a trajectory ended: its samples file's ``ended``, the agent/ended/* metrics."""

    DONE = "done"  # the environment said so
    ANSWER = "answer"  # the model answered without a tool call
    MAX_ASSISTANT_TURNS = "max_assistant_turns"  # multi_turn.max_assistant_turns model turns were taken
    MAX_USER_TURNS = "max_user_turns"  # multi_turn.max_user_turns replies were given
    LENGTH = "length"  # data.max_response_length is used up (the model's last turn may be cut at it)
    OVER_BUDGET = "over_budget"  # a reply does not fit what is left of data.max_response_length
    AGENT_OK = "agent_ok"  # a user's agent (an agent environment, through the gateway) returned
    AGENT_NO_CALLS = "agent_no_calls"  # it returned without calling the gateway
    AGENT_RAISED = "agent_raised"  # it raised
    AGENT_TIMED_OUT = "agent_timed_out"  # it ran past its agent_timeout_s


@dataclass(kw_only=True)
class Conversation:
    """One trajectory as its turns go: the sample being extended, those closed before it, and what it did so far."""

    trajectory: Trajectory  # the sample being extended
    messages: tuple[Message, ...]  # the conversation so far, as the template renders it
    template_kwargs: dict  # what the prompt was rendered with (the environment's tools)
    closed: list[Trajectory] = field(default_factory=list)  # earlier samples, closed where the template could not
    # extend them
    closed_versions: list[int] = field(default_factory=list)  # each closed sample's last model token's weights
    records: list[TurnRecord] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)  # tool name -> calls
    errors: Counter = field(default_factory=Counter)  # tool name -> calls that answered an error
    timeouts: Counter = field(default_factory=Counter)  # tool name -> calls that timed out
    used: list[str] = field(default_factory=list)  # the rollout replica of each model turn
    replica: RolloutClient | None = None  # the last model turn's, which the next prefers (its prefix cache)
    last_version: int = -1  # the weights that sampled the last model token (-1: no model turn yet)
    env_reward: float = 0.0
    final_text: str = ""  # the model's last turn, decoded
    model_turns: int = 0
    replies: int = 0

    def samples(self) -> tuple[Trajectory, ...]:
        return (*self.closed, self.trajectory)

    def trace(self, ended: Ended, episode: Episode) -> AgentTrace:
        return AgentTrace(turns=tuple(self.records), final_text=self.final_text, env_reward=self.env_reward,
                          episode_service=episode.service, rollouts=tuple(self.used),
                          last_versions=(*self.closed_versions, self.last_version), ended=ended,
                          tool_calls=self.calls, tool_errors=self.errors, tool_timeouts=self.timeouts,
                          env_seconds=episode.seconds, restarts=0)


class Sampled(NamedTuple):
    tokens: SampledTokens
    last_version: int
    truncated: bool  # it used up the room it was given
    replica: RolloutClient


@dataclass(kw_only=True)
class _TurnRequest:
    ids: list[int]
    room: int
    seed_index: int
    future: asyncio.Future
    tried: set
    attempts: int = 0
    sampling: Sampling | None = None  # None: the batch's; a gateway call's own temperature and top_p otherwise


class TurnDispatcher:
    """Gathers the waiting turns of a batch's trajectories into Generate calls, per rollout replica."""

    def __init__(self, rollout_set: RolloutSet, sampling: Sampling, seed: int, *, oldest: int, timeout_s: float,
                 calls_in_flight: int, trajectories: int):
        """``trajectories``: how many of the batch's trajectories may send turns (each says ``trajectory_ended``
        when it has ended)."""
        self.rollout_set, self.sampling, self.seed, self.oldest = rollout_set, sampling, seed, oldest
        self.timeout_s, self.calls_in_flight = timeout_s, calls_in_flight
        self.running = trajectories  # trajectories that may still send a turn
        self.unanswered = 0  # turns waiting or being sampled
        self.waiting: dict[RolloutClient, list[_TurnRequest]] = {}
        self.in_flight: Counter = Counter()  # replica -> its calls now
        self.turns: Counter = Counter()  # replica address -> turns it sampled
        self.calls: Counter = Counter()  # replica address -> Generate calls that sampled them
        self.tokens: Counter = Counter()  # replica address -> tokens it sampled
        self._tasks: set[asyncio.Task] = set()
        self._refreshing = asyncio.Lock()  # one wait for the rollouts at a time, whichever turn found none

    async def sample(self, ids: Sequence[int], room: int, seed_index: int, *, prefer: RolloutClient | None,
                     sampling: Sampling | None = None) -> Sampled:
        """One turn after ``ids``: at most ``room`` tokens, seeded from ``seed_index``, sampled on ``prefer``
        where it still serves the run, with ``sampling``'s temperature and top_p where given (the batch's
        otherwise; turns of one Generate call share them)."""
        request = _TurnRequest(ids=list(ids), room=room, seed_index=seed_index,
                               future=asyncio.get_running_loop().create_future(), tried=set(), sampling=sampling)
        self.unanswered += 1
        try:
            await self._queue(request, prefer)
            self._go_if_complete()
            return await request.future
        finally:
            self.unanswered -= 1

    def trajectory_ended(self) -> None:
        """One trajectory will send no more turns: the turns waiting no longer wait for it."""
        self.running -= 1
        self._go_if_complete()

    def _go_if_complete(self) -> None:
        """Send the waiting turns now where every trajectory still running has a turn waiting or being sampled: no
        other turn can join their calls (a lone turn goes at once; so does the last of a batch's to arrive)."""
        if self.unanswered >= self.running:
            for replica in list(self.waiting):
                self._pump(replica)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _queue(self, request: _TurnRequest, prefer: RolloutClient | None) -> None:
        replicas = self._replicas()
        while not replicas:
            async with self._refreshing:
                if not self._replicas():
                    await self.rollout_set.refresh()  # every rollout left: wait for the group's, with the weights
            replicas = self._replicas()
        untried = [r for r in replicas if r.address not in request.tried] or replicas
        replica = prefer if prefer in untried else min(
            untried, key=lambda r: len(self.waiting.get(r, ())) + self.in_flight[r] * MAX_TURNS_PER_CALL)
        self.waiting.setdefault(replica, []).append(request)
        if len(self.waiting[replica]) == 1:
            asyncio.get_running_loop().call_later(GATHER_S, self._pump, replica)

    def _replicas(self) -> list[RolloutClient]:
        pool = self.rollout_set.pool
        return list(pool.replicas) if pool is not None else []

    def _pump(self, replica: RolloutClient) -> None:
        """Send the turns waiting for ``replica`` as one call, if it may take another call now."""
        waiting = self.waiting.get(replica)
        if not waiting or self.in_flight[replica] >= self.calls_in_flight:
            return
        alike = [r for r in waiting if r.sampling == waiting[0].sampling]
        batch = alike[:MAX_TURNS_PER_CALL]
        self.waiting[replica] = [r for r in waiting if all(r is not b for b in batch)]
        self.in_flight[replica] += 1
        task = asyncio.ensure_future(self._call(replica, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, replica: RolloutClient, batch: list[_TurnRequest]) -> None:
        try:
            sampling = replace(batch[0].sampling or self.sampling, n=1, max_new_tokens=max(r.room for r in batch))
            generated = await replica.generate([r.ids for r in batch], sampling, seed=self.seed, first_index=0,
                                               timeout=self.timeout_s, seed_indices=[r.seed_index for r in batch])
            if int(generated.weight_versions.min()) < self.oldest:
                raise Unavailable(f"rollout {replica.address} sampled with weight version "
                                  f"{int(generated.weight_versions.min())}, older than {self.oldest}")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - retried where it may succeed elsewhere (decided in _failed)
            await self._failed(replica, batch, error)
            return
        finally:
            self.in_flight[replica] -= 1
            self._pump(replica)
        self.calls[replica.address] += 1
        # as lists once (indexing the tensors row by row costs about 0.15 ms a call of one turn)
        lengths, ids, logprobs = (generated.response_lens.tolist(), generated.response_ids.tolist(),
                                  generated.logprobs.tolist())
        firsts, lasts, cut = (generated.weight_versions.tolist(), generated.last_versions.tolist(),
                              generated.truncated.tolist())
        for row, (request, start) in enumerate(zip(batch, itertools.accumulate(lengths, initial=0))):
            kept = min(lengths[row], request.room)  # the call's length is its longest turn's room
            truncated = bool(cut[row]) or lengths[row] > request.room
            tokens = SampledTokens(ids=tuple(ids[start:start + kept]), logprobs=tuple(logprobs[start:start + kept]),
                                   weight_version=firsts[row])
            self.turns[replica.address] += 1
            self.tokens[replica.address] += kept
            if not request.future.done():
                request.future.set_result(Sampled(tokens=tokens, last_version=lasts[row], truncated=truncated,
                                                  replica=replica))

    async def _failed(self, replica: RolloutClient, batch: list[_TurnRequest], error: Exception) -> None:
        retryable = is_retryable(error) or isinstance(error, Unavailable)
        for request in batch:
            request.attempts += 1
            request.tried.add(replica.address)
            if not retryable or request.attempts >= TURN_ATTEMPTS:
                if not request.future.done():
                    request.future.set_exception(error if not retryable else Unavailable(
                        f"a turn failed on {request.attempts} attempts, last on {replica.address}: {error}"))
                continue
            await self._queue(request, prefer=None)
        self._go_if_complete()


class AgentGateway(Protocol):
    """What the agent loop asks of a run's OpenAI-compatible endpoint (services/coordinator/agent/gateway/server.py) for
    an environment whose episodes run users' agents."""

    @property
    def started(self) -> bool: ...

    async def start(self) -> str: ...

    async def close(self) -> None: ...

    def open(self, index: int, dispatcher: TurnDispatcher) -> GatewayAccess: ...

    def forget(self, key: str) -> None: ...

    async def trajectory(self, access: GatewayAccess, prompt: Prompt,
                         episode: Episode) -> tuple[tuple[Trajectory, ...], AgentTrace]: ...


class AgentLoop:
    """Runs a batch of prompts as trajectories (``run``), over a run's rollouts and env services."""

    def __init__(self, *, rollout_set: RolloutSet, env_set: EnvSet, settings: AgentSettings, tokenizer: Any,
                 notices: Notices, gateway: AgentGateway | None = None):
        """``gateway``: the run's OpenAI-compatible endpoint (services/coordinator/agent/gateway/), started with the
        first batch of an environment that runs users' agents."""
        self.rollout_set, self.env_set, self.settings = rollout_set, env_set, settings
        self.tokenizer, self.notices, self.gateway = tokenizer, notices, gateway

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.close()

    async def run(self, prompts: list[Prompt], sampling: Sampling, seed: int, *, oldest: int, timeout_s: float,
                  what: str) -> tuple[list[tuple[Trajectory, ...]], list[AgentTrace], TurnDispatcher]:
        """``sampling.n`` trajectories per prompt (trajectory i*n+j is sample j of prompt i), each as its samples
        (one, or more where its template could not extend it), each of its model turns sampled from weight
        versions >= ``oldest``, their episodes on the env replicas the run has as the batch (``what``: "step 5")
        begins."""
        dispatcher = TurnDispatcher(self.rollout_set, sampling, seed, oldest=oldest, timeout_s=timeout_s,
                                    calls_in_flight=self.settings.calls_in_flight,
                                    trajectories=len(prompts) * sampling.n)
        try:
            async with self.env_set.batch(what) as fleet:
                tools = fleet.tools(self.settings.environment)
                if fleet.runs_agent(self.settings.environment) and self.gateway is not None \
                        and not self.gateway.started:
                    await self.gateway.start()
                async with asyncio.TaskGroup() as group:  # one failing for good cancels the others (episodes close)
                    tasks = [group.create_task(self.trajectory(prompt, index * sampling.n + j, tools,
                                                               dispatcher=dispatcher,
                                                               fleet=fleet))
                             for index, prompt in enumerate(prompts) for j in range(sampling.n)]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            await dispatcher.close()
        results = [task.result() for task in tasks]
        return [t for t, _ in results], [trace for _, trace in results], dispatcher

    async def trajectory(self, prompt: Prompt, index: int, tools: tuple[dict, ...], *, dispatcher: TurnDispatcher,
                         fleet: EnvFleet) -> tuple[tuple[Trajectory, ...], AgentTrace]:
        """One trajectory on a replica of its batch's ``fleet``, started again from its prompt where its env replica
        fails."""
        try:
            return await self._trajectory_attempts(prompt, index, tools, dispatcher=dispatcher, fleet=fleet)
        finally:
            dispatcher.trajectory_ended()

    async def _trajectory_attempts(self, prompt: Prompt, index: int, tools: tuple[dict, ...], *,
                                   dispatcher: TurnDispatcher,
                                   fleet: EnvFleet) -> tuple[tuple[Trajectory, ...], AgentTrace]:
        busy_waits = 0  # of the episodes that failed
        gateway = self.gateway if fleet.runs_agent(self.settings.environment) else None
        for restarts in range(EPISODE_ATTEMPTS):
            opened: Episode | None = None
            access = gateway.open(index, dispatcher) if gateway is not None else None
            try:
                async with self.env_set.episode(episode_row(prompt), self.settings.environment,
                                                self.settings.max_parallel_calls, fleet=fleet, access=access) as opened:
                    if gateway is not None and access is not None:  # the user's agent drives it
                        samples, trace = await gateway.trajectory(access, prompt, opened)
                    else:
                        samples, trace = await self.turns(prompt, index, tools, episode=opened, dispatcher=dispatcher)
                    return samples, replace(trace, restarts=restarts, env_busy_waits=busy_waits + opened.busy_waits)
            except EnvLost as error:
                self.notices.log(f"trajectory {index}: its env replica failed ({error}); starting it again")
                busy_waits += opened.busy_waits if opened is not None else 0
                last = error
            finally:
                if gateway is not None and access is not None:
                    gateway.forget(access.key)
        raise Unavailable(f"trajectory {index}: its episode failed on {EPISODE_ATTEMPTS} env replicas: {last}")

    async def turns(self, prompt: Prompt, index: int, tools: tuple[dict, ...], *, episode: Episode,
                    dispatcher: TurnDispatcher) -> tuple[tuple[Trajectory, ...], AgentTrace]:
        """The turns of one trajectory in ``episode``: its samples, in order, and what it did."""
        talk = await self.conversation(prompt, tools, episode)
        while True:
            if (ended := self.turn_limit(talk)) is not None:
                break
            sampled = await self.model_turn(talk, index, dispatcher)           # the model's turn
            if sampled.truncated or talk.trajectory.room == 0:
                ended = Ended.LENGTH
                break
            step = await self.env_step(talk, episode, sampled)                   # the tools' or environment's answer
            if step.done or not step.messages:
                ended = Ended.DONE if step.done and step.info.get("calls") != [] else Ended.ANSWER
                break
            if self.settings.max_user_turns is not None and talk.replies >= self.settings.max_user_turns:
                ended = Ended.MAX_USER_TURNS
                break
            if not await self.append_replies(talk, step, sampled, episode=episode):      # token-exact
                ended = Ended.OVER_BUDGET
                break
        return talk.samples(), talk.trace(ended, episode)

    async def conversation(self, prompt: Prompt, tools: tuple[dict, ...], episode: Episode) -> Conversation:
        """The trajectory's start: the prompt with the episode's opening messages, rendered once with the tools."""
        template_kwargs = {"tools": list(tools)} if tools else {}
        messages: tuple[Message, ...] = (*prompt.messages, *episode.opening)
        prompt_ids = await asyncio.to_thread(render_prompt, self.tokenizer, messages, template_kwargs)
        if len(prompt_ids) > self.settings.max_prompt_length:
            raise ValueError(f"a prompt rendered with the environment's tools and opening messages has "
                             f"{len(prompt_ids)} tokens, over data.max_prompt_length={self.settings.max_prompt_length} "
                             f"(row {prompt.extra_info.get('index', '?')} of {prompt.data_source})")
        trajectory = Trajectory(prompt_ids=prompt_ids, max_response_length=self.settings.max_response_length)
        return Conversation(trajectory=trajectory, messages=messages, template_kwargs=template_kwargs)

    def turn_limit(self, talk: Conversation) -> Ended | None:
        """Why no model turn may follow (no room left, or max_assistant_turns), or None."""
        if talk.trajectory.room == 0:  # a reply filled the response: no token is left for another turn
            return Ended.LENGTH
        limit = self.settings.max_assistant_turns
        return Ended.MAX_ASSISTANT_TURNS if limit is not None and talk.model_turns >= limit else None

    async def model_turn(self, talk: Conversation, index: int, dispatcher: TurnDispatcher) -> Sampled:
        """The model's next turn, sampled after the conversation's ids (on the replica of the turn before, where it
        still serves the run) and appended to it."""
        started = time.monotonic()
        sampled = await dispatcher.sample(talk.trajectory.ids, talk.trajectory.room,
                                          index * TURN_SEEDS + talk.model_turns, prefer=talk.replica)
        talk.replica, talk.model_turns, talk.last_version = sampled.replica, talk.model_turns + 1, sampled.last_version
        talk.used.append(sampled.replica.address)
        talk.trajectory = extend(talk.trajectory, sampled.tokens)
        talk.final_text = self.tokenizer.decode(list(sampled.tokens.ids), skip_special_tokens=True)
        talk.records.append(TurnRecord(role="model", text=talk.final_text, tokens=len(sampled.tokens.ids),
                                       trained=True, weight_version=sampled.tokens.weight_version, tool="",
                                       seconds=time.monotonic() - started, sample=len(talk.closed)))
        return sampled

    async def env_step(self, talk: Conversation, episode: Episode, sampled: Sampled) -> EnvStep:
        """The episode's answer to the model's turn (its text as sampled, special tokens and all), counted."""
        step = await episode.step(self.tokenizer.decode(list(sampled.tokens.ids), skip_special_tokens=False))
        talk.env_reward += step.reward
        count_calls(step.info, talk.calls, talk.errors, timeouts=talk.timeouts)
        return step

    async def append_replies(self, talk: Conversation, step: EnvStep, sampled: Sampled, *, episode: Episode) -> bool:
        """The step's replies appended token-exactly, or (where the template cannot extend the conversation) a new
        sample begun with them in its prompt; False where they do not fit what is left of the response."""
        settings = self.settings
        reply = await asyncio.to_thread(
            render_reply, self.tokenizer, messages=talk.messages, sampled_ids=sampled.tokens.ids,
            replies=step.messages, room=talk.trajectory.room, max_reply_tokens=settings.max_reply_tokens,
            truncate_side=settings.truncate_side, template_kwargs=talk.template_kwargs)
        if isinstance(reply, OverBudget):
            return False
        if isinstance(reply, CannotExtend):
            following = await asyncio.to_thread(next_sample, self.tokenizer, talk.trajectory, reply.messages,
                                                template_kwargs=talk.template_kwargs)
            if isinstance(following, OverBudget):
                return False
            talk.closed.append(talk.trajectory)
            talk.closed_versions.append(sampled.last_version)
            talk.trajectory, appended = following, 0  # the replies are in the new sample's prompt
        else:
            talk.trajectory, appended = extend(talk.trajectory, reply), len(reply.ids)
        talk.messages, talk.replies = reply.messages, talk.replies + 1
        talk.records.extend(reply_records(talk.messages[len(talk.messages) - len(step.messages):], appended,
                                          episode.seconds / max(1, episode.steps), sample=len(talk.closed)))
        return True


def reply_records(replies: tuple[Message, ...], tokens: int, seconds: float, *, sample: int) -> list[TurnRecord]:
    """The records of one step's ``replies`` (as cut), the last one holding the ``tokens`` they were appended as
    (the template's tokens included; 0 where they open a new sample)."""
    records = [TurnRecord(role="reply", text=str(m.get("content", "")), tokens=0, trained=False, weight_version=None,
                          tool=str(m.get("name", "")), seconds=seconds, sample=sample) for m in replies]
    records[-1] = replace(records[-1], tokens=tokens)
    return records


def episode_row(prompt: Prompt) -> dict:
    """The dataset row an episode is reset on (verl's schema: the tools read extra_info.tools_kwargs)."""
    return {"data_source": prompt.data_source, "prompt": list(prompt.messages),
            "reward_model": {"ground_truth": prompt.ground_truth}, "extra_info": prompt.extra_info}


def count_calls(info: dict, calls: Counter, errors: Counter, *, timeouts: Counter) -> None:
    """Add one step's tool calls to the counts, by tool: its info's ``calls`` ([{tool, outcome}]), and the call
    that failed its worker (``error``, ``timed_out``, ``tool``: the env service's words)."""
    listed = info.get("calls")
    for call in listed if isinstance(listed, list) else []:
        if isinstance(call, dict):
            tool = str(call.get("tool") or "(unparsed)")
            calls[tool] += 1
            if call.get("outcome") != "ok":
                errors[tool] += 1
    if "error" in info:
        tool = str(info.get("tool") or "(environment)")
        calls[tool] += 1
        (timeouts if info.get("timed_out") else errors)[tool] += 1


def trajectory_batch(samples: list[Trajectory]) -> SequenceBatch:
    """The trajectories' samples as a batch: each one's prompt as rendered for it (the first: with the tools and the
    episode's opening; a later one: the conversation so far), its response with the loss mask (1 on the model's
    tokens)."""
    return SequenceBatch.of_lists([t.prompt_ids for t in samples], [t.response_ids for t in samples],
                                  [t.loss_mask for t in samples])


def agent_metrics(traces: list[AgentTrace], trajectories: list[tuple[Trajectory, ...]]) -> dict[str, float]:
    """verl's num_turns metrics and meshrl's of the tools, the environment and the trajectories' tokens (over all
    of each one's samples)."""
    turns = torch.tensor([float(len(t.turns)) for t in traces])
    model = torch.tensor([float(sum(sum(s.loss_mask) for s in t)) for t in trajectories])
    tool = torch.tensor([float(sum(len(s.loss_mask) - sum(s.loss_mask) for s in t)) for t in trajectories])
    calls = torch.tensor([float(sum(t.tool_calls.values())) for t in traces])
    metrics = {"num_turns/min": float(turns.min()), "num_turns/max": float(turns.max()),
               "num_turns/mean": float(turns.mean()),
               "agent/tool_calls/mean": float(calls.mean()), "agent/tool_call_rate": float((calls > 0).float().mean()),
               "agent/model_tokens/mean": float(model.mean()), "agent/tool_tokens/mean": float(tool.mean()),
               "agent/env_seconds/mean": sum(t.env_seconds for t in traces) / len(traces),
               "agent/env_reward/mean": sum(t.env_reward for t in traces) / len(traces),
               "agent/episodes_restarted": float(sum(t.restarts for t in traces)),
               "agent/env_busy_waits": float(sum(t.env_busy_waits for t in traces)),
               "agent/new_samples": float(sum(len(t) - 1 for t in trajectories))}
    outcomes = Counter(t.agent_outcome for t in traces if t.agent_outcome)
    if outcomes:  # an agent environment's (services/coordinator/agent/gateway/episodes.py)
        metrics["agent/gateway/calls/mean"] = sum(t.gateway_calls for t in traces) / len(traces)
        metrics["agent/gateway/segments/mean"] = sum(t.gateway_segments for t in traces) / len(traces)
        metrics.update({f"agent/episodes_failed/{why}": float(outcomes[why])
                        for why in ("no_calls", "raised", "timed_out")})
    for ending in (Ended.OVER_BUDGET, Ended.LENGTH):
        metrics[f"agent/ended/{ending}"] = float(sum(t.ended == ending for t in traces))
    for name, counts in (("tool_errors", "tool_errors"), ("tool_timeouts", "tool_timeouts")):
        total: Counter = sum((getattr(t, counts) for t in traces), Counter())
        metrics[f"agent/{name}"] = float(sum(total.values()))
        metrics.update({f"agent/{name}/{tool}": float(count) for tool, count in total.items()})
    return metrics
