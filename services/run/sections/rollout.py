"""The rollout (verl's ``actor_rollout_ref.rollout``): how responses are sampled, in training and in
validation, what becomes of generations in flight when weights change, and the rollout-side settings of the
trainer's logprob passes."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Literal

import pydantic
from pydantic import AfterValidator, Field, PositiveInt

from services.common.config import Section
from services.common.limits import MAX_PROBE_TOP_K, MIN_TEMPERATURE, check_temperature
from services.run.sections.lora import LoadFormat
from services.run.tool_calls import check_format


class ValKwargsConfig(Section):
    """How validation samples (verl's actor_rollout_ref.rollout.val_kwargs): greedy by default."""

    n: PositiveInt = 1
    """Responses per validation prompt: mean@n, and best@k, worst@k and maj@k for k = 2, 4, ..., n."""
    temperature: Annotated[float, AfterValidator(partial(check_temperature, "temperature"))] = 0.0
    """Sampling temperature of validation when do_sample is true: 0 (greedy) or at least 0.001."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling of validation when do_sample is true."""
    top_k: Literal[-1] = -1
    """Accepted for verl's configs; only -1 (no top-k cut), which is all meshrl's engines do."""
    do_sample: bool = False
    """False: greedy decoding, whatever temperature and top_p say (verl's meaning); true: sample at them."""

    @property
    def sampling_temperature(self) -> float:
        """The temperature validation decodes at (0: greedy)."""
        return self.temperature if self.do_sample else 0.0

    @property
    def sampling_top_p(self) -> float:
        return self.top_p if self.do_sample else 1.0


class GatewayConfig(Section):
    """The OpenAI-compatible endpoint (POST /v1/chat/completions, GET /v1/models) a run serves while the episodes
    of an environment that runs users' agents go (services/coordinator/agent/gateway/,
    docs/guides/existing-agents.md)."""

    host: str = "127.0.0.1"
    """The address it binds: loopback by default, so that only this host's processes reach it (the env services
    relay their agents' calls to it); an env service on another host needs an address it can reach. Every call
    must carry the key its episode was given."""
    port: int = Field(0, ge=0, le=65535)
    """Its TCP port; 0: one the system picks (the env services are told it with each episode)."""
    max_n: PositiveInt = Field(8, le=256)
    """Completions one call may ask for (n); a call asking for more is refused."""


class MultiTurnConfig(Section):
    """Multi-turn rollouts with tools or environments (verl's actor_rollout_ref.rollout.multi_turn): each
    trajectory is a conversation the coordinator's agent loop runs turn by turn, the model's turns sampled on a
    rollout and the tools' or environment's replies from an env service (placement.env), all of it within
    data.max_response_length, only the model's tokens trained."""

    enable: bool = False
    """Run every prompt as a multi-turn trajectory (false: one response per prompt, as before)."""
    max_assistant_turns: PositiveInt | None = None
    """Most model turns of a trajectory; null = as many as data.max_response_length holds (verl's key)."""
    max_user_turns: PositiveInt | None = None
    """Most tool or environment replies of a trajectory; null = no bound but the response length (verl's key)."""
    max_parallel_calls: PositiveInt = 1
    """Tool calls run of one model turn; the env service answers the others with one error reply (verl's key;
    the smaller of this and the env service's own max_parallel_calls applies)."""
    max_tool_response_length: PositiveInt = 256
    """Tokens kept of one tool or environment reply (verl counts characters), cut as
    tool_response_truncate_side says with verl's "(truncated)" marker."""
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of an over-long reply is KEPT: left = its start, right = its end, middle = both ends (verl's
    key and meaning)."""
    format: str = "hermes"
    """How the model writes tool calls: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as
    Qwen2.5 and Qwen3 do); services/run/tool_calls.py lists the formats parsed."""
    tool_config_path: str | None = None
    """verl's tool-config YAML (tools: [{class_name, config, tool_schema}]). The env services host the tools
    (their own config names them, so that a run config never names code); coordctl start-run --local starts
    its env service with this file, and a run checks that its env services host every tool the file names."""
    environment: str = "tools"
    """Which environment of the env services runs the episodes (an env service's environments, by name)."""
    agent: str | None = None
    """A user's agent, path/to/file.py:function (``async def run(client, row) -> float | None``, given an
    openai.AsyncOpenAI pointed at its episode): coordctl start-run --local starts its env service with an
    environment that runs it per prompt (docs/guides/existing-agents.md), with tool_config_path (if given) as the
    schemas of the tools the agent passes (never run by the env service: the agent runs its tools). A cluster's
    env services name their agents in their own config."""
    gateway: GatewayConfig = GatewayConfig()
    env_reward_weight: float = Field(1.0, allow_inf_nan=False)
    """A trajectory's score: the reward service's score of the whole response plus this times the sum of the
    environment's step rewards (verl sums tool rewards into the score: 1.0); 0 = the reward service alone."""

    @pydantic.field_validator("format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        check_format(name)
        return name


class WeightCheckConfig(Section):
    """The weight check after every sync (meshrl's; docs/architecture/weight-sync.md): each rollout scores a small
    fixed probe (sequences of the first batch trained, prompt and the model's own response) and its logprobs are
    compared with the actor's for the same weights. A rollout over the tolerance is sent the weights again; over
    it again, it leaves the run."""

    enable: bool = True
    """Check every rollout's weights after every sync (false: the checksums of the buckets are the only check)."""
    probe_sequences: PositiveInt = 4
    """Sequences in the probe: one sample each of the first batch's first prompts."""
    tolerance_mean: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Largest mean |rollout - trainer logprob| over the probe's response tokens a rollout may show; null = the
    figure measured for its engine and dtype (docs/architecture/weight-sync.md)."""
    tolerance_max: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Largest |rollout - trainer logprob| of any one probe token; null = the figure measured for its engine and
    dtype."""
    top_k: int = Field(20, ge=1, le=MAX_PROBE_TOP_K)
    """The next-token distributions at the probe's positions are compared over the rollout's top_k most likely
    tokens there and the rest of the vocabulary as one bucket (at most 20: vLLM's max_logprobs)."""
    tolerance_topk_kl: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Largest mean over the probe's positions of KL(rollout || trainer) over those buckets a rollout may show;
    null = the figure measured for its engine and dtype (docs/architecture/weight-sync.md)."""
    mismatch_kl_warning: float | None = Field(0.1, gt=0, allow_inf_nan=False)
    """A step whose training/rollout_mismatch_kl (the trainer's probabilities of the sampled tokens against the
    rollouts') is over this is reported, with or without the probe, and the run goes on; null: never. Healthy runs
    measured 2e-5 to 1.3e-2 (vLLM, bf16) and about 2e-3 (CPU); a GPU run whose swaps preempted the requests in
    flight passed the probe and showed 0.58 to 0.85 from its second step on, then collapsed."""


class RolloutConfig(Section):
    name: Literal["hf", "vllm", "sglang", "sglang_async"] = "hf"
    """verl's choice of rollout engine. A meshrl run samples with the engine each rollout service was started with
    (python -m services.rollout engine=hf|vllm); with vllm, coordctl start-run --local passes
    gpu_memory_utilization and tensor_model_parallel_size on to the rollout it starts. meshrl has no SGLang
    engine: sglang and sglang_async (verl's multi-turn scripts) are accepted and reported as not used."""
    n: PositiveInt = 8
    """Responses sampled per prompt."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False)
    """Sampling temperature, at least 0.001: responses are drawn from softmax(logits / temperature). The trainer
    divides the logits by the same temperature for the old, reference and updated logprobs and the entropy, so
    the PPO ratio compares the distribution the samples came from."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: each token is drawn from the smallest set of most likely tokens whose probabilities
    add up to top_p (1 = the whole vocabulary). Only sampling applies it: the trainer's logprobs are those of
    the whole temperature-scaled distribution."""
    stop_token_ids: list[int] = []
    """Token ids that end a response besides EOS."""
    enable_rollout_routing_replay: bool = False
    """The rollouts record the experts each token was routed to and they travel with the sample (an MoE model on
    hf rollouts); the actor then reports training/routing_agreement, and with actor.router_replay.mode R3 routes
    by them. R3 records them whatever this says."""
    log_prob_micro_batch_size_per_gpu: PositiveInt | None = None
    """Sequences per forward pass of the trainer's old and reference logprobs; null = the actor's
    ppo_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Cut those passes by a token budget; null = the actor's use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: PositiveInt | None = None
    """Their token budget (passes without gradients can hold more); null = the actor's
    ppo_max_token_len_per_gpu."""
    free_cache_engine: bool = False
    """Put the rollout engines that share the actor trainer's GPU to sleep while it works on a step (vLLM sleep
    level 1: KV cache freed, weights moved to CPU memory) and wake them for the weight sync (those rollout
    services started with enable_sleep_mode); rollouts on other GPUs stay awake. Synchronous runs only."""
    partial_rollout: Literal["keep", "finish", "restart"] = "keep"
    """What becomes of the Generate calls in flight when new weights arrive (asynchronous runs, where
    generation goes on during a sync): keep = they are held only while the weights are swapped in and go on
    under the new version with the tokens (and KV cache) they have, each sample recording the first and last
    version of its tokens (its staleness counted from the first); on a vLLM rollout with prefix caching on
    (multi-turn runs) keep acts as finish, since vLLM clears its prefix cache under running requests only by
    preempting them; finish = they complete under the old version, the swap waiting for them; restart = they
    are stopped and sampled again, whole, under the new version, with the same seeds: fresher samples for the
    compute thrown away."""
    val_kwargs: ValKwargsConfig = ValKwargsConfig()
    """Sampling of validation (verl's key)."""
    weight_check: WeightCheckConfig = WeightCheckConfig()
    """The check of every rollout's weights after every sync (meshrl's key)."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Multi-turn trajectories with tools or environments (verl's key)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """verl's share of a GPU's memory for vLLM. In meshrl a rollout service is started with its own
    gpu_memory_utilization; coordctl start-run --local passes this one to the rollout it starts, a run on a
    cluster reports it as not used."""
    tensor_model_parallel_size: PositiveInt | None = None
    """verl's tensor parallelism of vLLM. As gpu_memory_utilization: the rollout service's own
    tensor_parallel_size; --local passes this one on, a cluster run reports it as not used."""
    load_format: LoadFormat | None = None
    """verl's way for vLLM to load the model before the first sync (dummy: random weights). Accepted; a meshrl
    rollout loads the model folder it is given (real weights, so validation before the first sync is meaningful)
    and then takes the trainer's weights over the weight channel: reported as not used."""
    layered_summon: bool | None = None
    """verl's LoRA sync gathers the FSDP shards one layer at a time to cut peak memory. Accepted; meshrl's sender
    gathers every sharded tensor one at a time into its buckets anyway (and with LoRA sends only the adapters),
    so this is what it always does: reported as not used."""
