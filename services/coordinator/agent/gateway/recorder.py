"""An episode's calls as trajectories: token-exact, by the agent loop's prefix rule
(services/coordinator/agent/turns.py).

A user's agent sends the whole conversation with every call. The gateway never tokenizes it again where it can
avoid it: each completion it returned is remembered (``Leaf``: the conversation it answered, the ids sampled, the
text the template renders back for them), and a call whose messages are that conversation, then that
completion's assistant message (as the gateway returned it: its tool-call ids, or its content), then replies, is
that leaf extended: its prompt is the leaf's ids plus the replies' ids as ``turns.render_reply`` bridges them,
never re-rendered. A call that extends no leaf (the agent rewrote or dropped earlier turns, started afresh, or
the template cannot extend: ``CannotExtend``) starts a new segment whose prompt is its conversation rendered
fresh. Every leaf left at the episode's end is one training sample: its prompt, then the model's sampled
tokens (loss mask 1, their rollout logprobs and weight versions) and the replies' (mask 0); a call whose
``tool_choice`` forces the turn's opening (wire.ToolChoice) has the opening's ids before the sampled ones, fed to
the model and untrained (mask 0), and its turn, opening and all, is what a later call extends. With ``n`` > 1 the
choices the agent did not go on with are leaves too: the policy sampled them and they are trained with the
episode's score.

Replies are never cut here (the agent saw them whole; a cut one would make the next call extend nothing): a
call whose replies do not fit what is left of the response is refused as over the context (``RequestError``,
OpenAI's ``context_length_exceeded``). The budget is the run's: the first prompt fits data.max_prompt_length, a
sample's response tokens fit data.max_response_length, and a new segment's whole sequence fits the two
together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from services.coordinator.agent.gateway.wire import RequestError, hermes_text, message_text
from services.coordinator.agent.turns import (CannotExtend, Message, OverBudget, ReplyTokens, SampledTokens,
                                              Trajectory, extend, ids_text, render_prompt, render_reply,
                                              text_ids, without_stop)


class Budget(NamedTuple):
    max_prompt_length: int  # of an episode's first prompt
    max_response_length: int  # of each sample's response tokens, the model's and the replies'


@dataclass(frozen=True, kw_only=True)
class Leaf:
    """A completion the gateway returned that no later call has extended (yet)."""

    trajectory: Trajectory  # its sample: ending with the completion's sampled ids
    messages: tuple[Message, ...]  # the conversation it answered, in the template's form
    turn_ids: tuple[int, ...]  # the model's turn: its opening (if the call forced one) and the ids it sampled
    text: str  # the completion as the template renders it back (special tokens kept, its stop token off)
    tools: tuple[dict, ...]
    last_version: int  # the weights that sampled its last token
    openings: frozenset[int] = frozenset()  # where its forced openings start in its response (each the reply turn
    # right before a model turn that a call's tool_choice made begin with it)


class Plan(NamedTuple):
    """How one call's completions are recorded: each extends ``base`` (its ids: the call's conversation) and
    ``opening``."""

    base: Trajectory
    messages: tuple[Message, ...]  # the call's conversation, in the template's form
    tools: tuple[dict, ...]
    extends: Leaf | None  # None: the call starts a new segment
    opening: tuple[int, ...] = ()  # the ids the model's turn is made to begin with (wire.ToolChoice), fed to it
    # after the conversation: in the sample, untrained

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """What the model samples after."""
        return self.base.ids + self.opening

    @property
    def room(self) -> int:
        """The most tokens the model may sample."""
        return self.base.room - len(self.opening)


@dataclass(kw_only=True)
class EpisodeRecording:
    """What one episode's calls sampled, as leaves (``samples``), and its counts."""

    budget: Budget
    leaves: list[Leaf] = field(default_factory=list)
    calls: int = 0  # completions recorded (a call's choices count once)
    segments: int = 0  # calls that started a new segment (the first call included)
    returned: dict[str, str] = field(default_factory=dict)  # tool-call id, or "content:" + content -> leaf text
    final_text: str = ""  # the latest call's first completion, as returned: what the reward service scores

    def plan(self, tokenizer: Any, messages: Sequence[dict], tools: tuple[dict, ...], *, opening: str = "") -> Plan:
        """The prompt of a call with ``messages`` (OpenAI's form) and ``tools``, its model's turn made to begin
        with ``opening``; RequestError where it is over the budget. Renders with the tokenizer: call it off the
        event loop."""
        plan = self._conversation_plan(tokenizer, messages, tools)
        if not opening:
            return plan
        plan = plan._replace(opening=text_ids(tokenizer, opening))
        if plan.room < 1:
            raise over_context(f"the call's opening ({opening!r}, {len(plan.opening)} tokens) leaves no room of the "
                               f"{plan.base.room} left of the episode's response")
        return plan

    def _conversation_plan(self, tokenizer: Any, messages: Sequence[dict], tools: tuple[dict, ...]) -> Plan:
        conversation = self.template_messages(messages)
        kwargs = {"tools": list(tools)} if tools else {}
        for leaf in reversed(self.leaves):
            replies = following(leaf, conversation, tools)
            if replies is None:
                continue
            reply = render_reply(tokenizer, messages=leaf.messages, sampled_ids=leaf.turn_ids, replies=replies,
                                 room=leaf.trajectory.room, max_reply_tokens=leaf.trajectory.room + 1,
                                 truncate_side="left", template_kwargs=kwargs)
            if isinstance(reply, CannotExtend):
                break  # the template rewrites what came before: a new segment
            if isinstance(reply, OverBudget) or reply.truncated or len(reply.ids) >= leaf.trajectory.room:
                raise over_context(f"the replies need more tokens than the {leaf.trajectory.room} left of the "
                                   f"episode's response (data.max_response_length={self.budget.max_response_length})")
            return Plan(base=extend(leaf.trajectory, reply), messages=tuple(reply.messages), tools=tools,
                        extends=leaf)
        prompt_ids = render_prompt(tokenizer, conversation, kwargs)
        room = self._room(len(prompt_ids))
        return Plan(base=Trajectory(prompt_ids=prompt_ids, max_response_length=room), messages=conversation,
                    tools=tools, extends=None)

    def _room(self, prompt_length: int) -> int:
        """The response room of a new segment whose prompt has ``prompt_length`` ids; RequestError if none."""
        max_prompt, max_response = self.budget
        if not self.leaves and prompt_length > max_prompt:
            raise over_context(f"the prompt has {prompt_length} tokens, over data.max_prompt_length={max_prompt}")
        room = min(max_response, max_prompt + max_response - prompt_length)
        if room < 1:
            raise over_context(f"the conversation has {prompt_length} tokens: no room is left of "
                               f"data.max_prompt_length + data.max_response_length = {max_prompt + max_response}")
        return room

    def record(self, plan: Plan, completions: Sequence[tuple[SampledTokens, int]], tokenizer: Any,
               *, returned: Sequence[dict]) -> None:
        """The call's completions (sampled tokens, last weight version), each a leaf, in place of the leaf the call
        extended; ``returned``: the assistant message returned for each."""
        if plan.extends is None:
            self.segments += 1
        elif plan.extends in self.leaves:
            self.leaves.remove(plan.extends)
        base = extend(plan.base, ReplyTokens(ids=plan.opening, truncated=False, messages=())) if plan.opening \
            else plan.base
        openings = plan.extends.openings if plan.extends is not None else frozenset()
        if plan.opening:
            openings |= {len(plan.base.response_ids)}
        for (tokens, last_version), message in zip(completions, returned):
            turn_ids = plan.opening + tokens.ids
            text = without_stop(tokenizer, ids_text(tokenizer, turn_ids, skip_special_tokens=False))
            self.leaves.append(Leaf(trajectory=extend(base, tokens), messages=plan.messages, turn_ids=turn_ids,
                                    text=text, tools=plan.tools, last_version=last_version, openings=openings))
            for call in message.get("tool_calls") or []:
                self.returned[call["id"]] = text
            if not message.get("tool_calls"):
                self.returned["content:" + message_text(message.get("content"))] = text
        self.calls += 1
        self.final_text = message_text(returned[0].get("content")) if returned else ""

    def template_messages(self, messages: Sequence[dict]) -> tuple[Message, ...]:
        """``messages`` as the chat template reads them: role and text content (a tool's name where given); an
        assistant message the gateway returned as the text the model sampled, any other with its tool calls
        written as Hermes blocks."""
        return tuple(self._template_message(m) for m in messages)

    def _template_message(self, message: dict) -> Message:
        role, content = message["role"], message_text(message.get("content"))
        if role == "developer":
            role = "system"
        if role == "assistant":
            calls = message.get("tool_calls") or []
            ids = [call.get("id") for call in calls if isinstance(call, dict)]
            if ids and ids[0] in self.returned:
                return {"role": role, "content": self.returned[ids[0]]}
            if not calls and "content:" + content in self.returned:
                return {"role": role, "content": self.returned["content:" + content]}
            return {"role": role, "content": hermes_text(content, calls) if calls else content}
        name = message.get("name")
        return {"role": role, "content": content} | ({"name": name} if isinstance(name, str) and name else {})


def following(leaf: Leaf, conversation: tuple[Message, ...], tools: tuple[dict, ...]) -> list[Message] | None:
    """The messages after ``leaf``'s completion where ``conversation`` goes on from it (its conversation, then its
    completion as the template renders it, then at least one reply), else None."""
    cut = len(leaf.messages)
    if tools != leaf.tools or len(conversation) < cut + 2 or conversation[:cut] != leaf.messages:
        return None
    if conversation[cut] != {"role": "assistant", "content": leaf.text}:
        return None
    return list(conversation[cut + 1:])


def over_context(message: str) -> RequestError:
    return RequestError(400, message, code="context_length_exceeded", param="messages")
