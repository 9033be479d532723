"""A LoRA run on the vLLM engine: adapters loaded from the tensors the weight channel brought, never from files.

vLLM 0.20's way in is a LoRARequest carrying a folder, read by the worker the first time a request names the
adapter's integer id. meshrl goes around the folder: inside each worker (``vllm_worker``) the received factors
become vLLM's ``LoRAModel`` (``LoRAModel.from_lora_tensors``, the constructor its folder loader ends in), which
is added to the worker's LoRA manager under a new id. A request that carries a LoRARequest of that id finds it
loaded (vLLM moves it into a GPU slot at the first step that serves it), so its path is never read. What this
module holds runs without vLLM:

- the engine arguments of a LoRA engine (``lora_engine_args``);
- the names vLLM's loader expects of the factors (``peft_tensors``: PEFT's, as in ``adapter_model.safetensors``)
  and the PEFT config it builds an adapter's settings from (``peft_config``);
- which adapter versions stay loaded (``AdapterWindow``): each sync's adapter gets a new id; the last
  ``versions`` (the run's max_staleness + 1; at least the new one and the one served until it), and any a
  call in flight still uses, so that every call finishes under the adapter it began with; older ones are
  removed.

The factors come scaled (``common.adapters``: B already multiplied by lora_alpha / rank), so the config given
to vLLM has lora_alpha = r: a scale of 1.

vLLM's prefix cache keys each block by the adapter's name besides its tokens (``_gen_lora_extra_hash_keys``
in ``vllm/v1/core/kv_cache_utils.py``) and every version has a name of its own, so a cached prefix is reused
only under the version that computed it: a LoRA swap needs no cache reset (which vLLM refuses anyway while the
calls in flight, here going on, hold blocks); old versions' blocks age out as any unused block does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.adapters import adapter_pairs
from services.run.lora import PEFT_PREFIX

if TYPE_CHECKING:
    import torch

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.20 accepts
SPARE_ADAPTERS = 2  # adapters a LoRA engine may hold beyond its versions: older ones calls in flight still use
IN_MEMORY = "meshrl://in-memory"  # the LoRARequest's path: never read, the adapter is already loaded


@dataclass(frozen=True)
class AdapterServing:
    """How a rollout serves a LoRA run: adapters up to ``rank``, ``versions`` of them loaded at once."""

    rank: int
    versions: int


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of ``rank`` (ValueError past its largest)."""
    fitting = [choice for choice in VLLM_LORA_RANKS if choice >= rank]
    if not fitting:
        raise ValueError(f"actor_rollout_ref.model.lora_rank: {rank} is more than the vllm engine serves "
                         f"({VLLM_LORA_RANKS[-1]}); choose at most {VLLM_LORA_RANKS[-1]} or serve with engine=hf")
    return fitting[0]


def lora_engine_args(serving: AdapterServing) -> dict[str, object]:
    """vLLM engine arguments for a LoRA run: LoRA on, ranks up to the run's, a GPU slot for each version kept,
    room for SPARE_ADAPTERS more (older versions calls in flight still use)."""
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(serving.rank), "max_loras": serving.versions,
            "max_cpu_loras": serving.versions + SPARE_ADAPTERS}


def peft_tensors(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The factors of a received adapter (``M.lora_A``, ``M.lora_B``, M the base model's module name) under the
    names vLLM's loader reads from a PEFT adapter file: ``base_model.model.M.lora_A.weight`` and
    ``...lora_B.weight``. ValueError naming a module whose factors do not pair up."""
    tensors = {}
    for module, (a, b) in adapter_pairs(named).items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    return tensors


def peft_config(named: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """The adapter_config.json vLLM would read beside these factors: the largest rank among them, alpha equal to
    it (the factors come scaled), the module names they adapt (the last part of each name)."""
    pairs = adapter_pairs(named)
    rank = max(a.shape[0] for a, _ in pairs.values())
    return {"r": rank, "lora_alpha": rank, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs}),
            "bias": "none"}


def unserved_modules(modules: list[str], served: set[str]) -> list[str]:
    """The modules of ``modules`` whose last name part is not one vLLM serves LoRA on (``served``: the model's
    LoRA modules with their packed parts, e.g. q_proj, k_proj, v_proj for qkv_proj)."""
    return sorted(module for module in modules if module.rsplit(".", 1)[-1] not in served)


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter version loaded in vLLM under ``adapter_id``."""

    version: int
    adapter_id: int

    @property
    def name(self) -> str:
        """Its LoRARequest name, which vLLM's prefix cache keys blocks by: one per id, so one per version."""
        return f"meshrl-v{self.version}-{self.adapter_id}"


class AdapterWindow:
    """The adapter versions a LoRA engine has loaded, oldest first, the last one served to new calls; the one
    writer of which are loaded. Each sync's adapter gets an id never used before (a sync that failed part way
    may have left its id on some workers, which the next sync's removal clears)."""

    def __init__(self, versions: int, capacity: int):
        self.versions = versions  # the last this many stay loaded
        self.capacity = capacity  # the most vLLM holds (its max_cpu_loras)
        self.loaded: list[LoadedAdapter] = []
        self._last_id = 0

    @property
    def current(self) -> LoadedAdapter | None:
        """The adapter new calls are served with (None before the first sync: the base model)."""
        return self.loaded[-1] if self.loaded else None

    def new_id(self) -> int:
        """An id for the next sync's adapter."""
        self._last_id += 1
        return self._last_id

    def kept_beside_new(self, in_use: set[int]) -> list[LoadedAdapter]:
        """The loaded adapters that stay once a new one is loaded: the last ``versions`` - 1 (with the new one,
        the last ``versions``) and at least the one served until now (calls may begin under it until the new
        one is served), and older ones whose id is in ``in_use`` (calls in flight under them). RuntimeError when
        these and the new one are more than ``capacity``."""
        recent = self.loaded[-max(self.versions - 1, 1):] if self.loaded else []
        older = [adapter for adapter in self.loaded[:len(self.loaded) - len(recent)] if adapter.adapter_id in in_use]
        if len(older) + len(recent) + 1 > self.capacity:
            raise RuntimeError(f"calls in flight still use {len(older)} adapter versions older than the last "
                               f"{self.versions}: with the new one that is more than the {self.capacity} this vLLM "
                               "engine holds; the previous adapter goes on serving, and a later sync loads the new "
                               "one once those calls finish")
        return older + recent

    def serve(self, kept: list[LoadedAdapter], new: LoadedAdapter) -> None:
        """Record ``kept`` and ``new`` as what is loaded (every worker took ``new``): ``new`` is served from now
        on."""
        self.loaded = [*kept, new]
