"""What ``coordctl start-run --local`` builds before it starts a run: the ``local`` section of its config.

Only coordctl reads this section; it is taken off the config before the rest is validated as the
``RunConfig`` that the coordinator and the trainer parse, so a run config never carries it.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, PositiveInt

from services.common.config import Section


class TinyModelConfig(Section):
    """The random-init Qwen2-architecture model (Qwen3-MoE with num_experts) with a character tokenizer, built
    when no model path is given (as small as the local default's or a few hundred million parameters: 1024 wide
    and 16 layers deep is about 200M)."""

    hidden_size: PositiveInt = 128
    """Width of the model (the MLP is four times as wide)."""
    num_layers: PositiveInt = 2
    """Decoder layers."""
    num_heads: PositiveInt = 4
    """Attention heads; must divide hidden_size."""
    seed: int = 0
    """Seed of the random initialisation (the same seed and shape give the same weights)."""
    chat: bool = False
    """The chat variant, for multi-turn runs with tools: its characters also cover tool calls' JSON, ChatML's
    <|im_start|> and <|im_end|> (the EOS) and Qwen2.5's <tool_call> and <tool_response> tags are one token each,
    and its chat template is Qwen2.5's ChatML with the tools named in one short line."""
    num_experts: int = Field(0, ge=0)
    """0: a dense Qwen2 model. More: a Qwen3-MoE mixture of experts, this many experts in each layer's MLP, each
    4 * hidden_size / experts_per_token wide (a token's MLP is as wide as the dense model's)."""
    experts_per_token: PositiveInt = 2
    """Experts each token is routed to (Qwen3-MoE's num_experts_per_tok; its router weights normalised to sum to
    1); at most num_experts. Unused by a dense model."""

    @pydantic.model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        return self

    @pydantic.model_validator(mode="after")
    def _experts_cover_a_token(self) -> TinyModelConfig:
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be at most num_experts "
                             f"({self.num_experts})")
        return self


class TaskConfig(Section):
    """What a synthetic task generates: training rows, and held-out rows training never sees."""

    rows: PositiveInt = 20000
    """Rows generated for training."""
    seed: int = 1
    """Seed of the generated rows (the held-out ones use seed + 1)."""
    val_rows: int = Field(256, ge=0)
    """Held-out rows for validation (data.val_files), drawn from what training never sees; 0 = none."""
    held_out_share: float = Field(0.1, gt=0, lt=1)
    """Share of everything the task can ask that is held out of training for validation."""


class SyntheticTaskConfig(TaskConfig):
    """The digit-reversal task (verl's data schema)."""

    min_digits: PositiveInt = 2
    """Fewest digits of a prompt."""
    max_digits: PositiveInt = 5
    """Most digits of a prompt."""


class ArithmeticTaskConfig(TaskConfig):
    """Multi-step arithmetic as word problems, answered GSM8K's way ("... #### 14") and scored by its rule."""

    rows: PositiveInt = 50000
    """Problems generated for training."""
    val_rows: int = Field(512, ge=0)
    """Held-out problems for validation (data.val_files), never among the training problems; 0 = none."""
    min_steps: PositiveInt = 1
    """Fewest operations of a problem (adding, giving away, multiplying by 2 to 4)."""
    max_steps: PositiveInt = 3
    """Most operations of a problem."""
    largest: PositiveInt = 20
    """Largest number a problem starts with or adds."""


class LookupTaskConfig(TaskConfig):
    """Look up a key's code with a tool: "code of QX?" is answered by the 4 digits the lookup tool
    (examples/local_tools/lookup.py) gives for QX, a keyed hash no prompt gives away. Each row carries the worked
    trajectory (tool call, tool reply, answer) that a warm start teaches; held-out keys are never trained on."""

    key_letters: PositiveInt = 2
    """Capital letters of a key (2: 676 keys, of which held_out_share are held out)."""


class LocalService(Section):
    """One service that --local starts, where local.services lists several of a kind."""

    settings: list[str] = []
    """Its key=value settings (python -m services.<kind> --help lists them)."""
    env: dict[str, str] = {}
    """Environment variables it starts with, e.g. {CUDA_VISIBLE_DEVICES: "1"}: a vLLM rollout works on the GPUs
    they show it."""


class LocalConfig(Section):
    """What ``coordctl start-run --local`` builds, once, into its cache folder, and how it starts the services."""

    tiny_model: TinyModelConfig = TinyModelConfig()
    """Used when actor_rollout_ref.model.path is empty."""
    task: Literal["reverse", "arithmetic", "lookup"] = "reverse"
    """The synthetic task generated when data.train_files is empty (and its held-out part when data.val_files
    is empty too): synthetic_task (reverse digit strings), arithmetic_task or lookup_task (a multi-turn task
    with a tool: a tiny model built for it must be the chat variant)."""
    synthetic_task: SyntheticTaskConfig = SyntheticTaskConfig()
    """The digit-reversal task."""
    arithmetic_task: ArithmeticTaskConfig = ArithmeticTaskConfig()
    """The arithmetic word problems."""
    lookup_task: LookupTaskConfig = LookupTaskConfig()
    """The key lookup with a tool."""
    services: dict[Literal["trainer", "rollout", "reward", "env"], list[str] | list[LocalService]] = {}
    """key=value settings of the services started, by kind, e.g. {rollout: [engine=vllm, device=cuda]} on a GPU
    machine (python -m services.<kind> --help lists them); or a list of {settings, env}, one service each, e.g.
    a rollout on each GPU (examples/every_gpu_generating.yaml). An env service is started only for a run with
    actor_rollout_ref.rollout.multi_turn.enable."""

    def launches(self, kind: str) -> list[LocalService]:
        """The services of ``kind`` to start: one per entry of local.services' list of {settings, env}, or one
        with its list of settings (none given: one without settings)."""
        given = self.services.get(kind, [])  # type: ignore[call-overload]  # any kind; one not listed gets []
        if all(isinstance(entry, str) for entry in given):
            return [LocalService(settings=list(given))]
        return list(given)
