"""A transformers causal-LM engine for the rollout service (CPU, or GPU without vLLM).

Sampling is done here, token by token with the model's KV cache, so that every
choice is under our control and reproducible: each sequence draws from its own
``torch.Generator`` seeded from (request seed, sequence index) by
``sampling.hash_seed``, so a prompt gets the same samples whichever replica or
batch it lands in.

The reported logprob of a sampled token is taken from the temperature-scaled
distribution before top-p truncation, the same quantity the trainer computes.
Temperature 0 decodes greedily (validation's default, as in verl).

The KV cache is a ``DynamicCache`` made here and filled in place by every
forward, so it is never read back from the output. transformers renamed the
forward's ``past_key_values`` argument to ``cache``: 5.24 warns that the old
name is deprecated, 5.17 knows only the old one and would silently drop a
``cache`` into its ``**kwargs``. So the cache goes under the name the model's
forward declares.

A LoRA run's syncs bring adapters, not weights (``load_adapter``): the engine
keeps the base of each adapted layer and serves base + B @ A, merged into the
layer's weight. Merged rather than a PEFT-wrapped model: each token step costs
what it costs without LoRA (no extra matmuls per layer), for a copy of the
adapted layers' base weights kept beside them, and nothing in the sampling
code knows about adapters.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from transformers import DynamicCache

from services import algos
from services.common.adapters import adapter_pairs, merged_weight
from services.run.experts import per_expert_tensors
from services.run.routing import RouteRecorder
from services.rollout.sampling import Completion, SamplingSettings, TopTokens, hash_seed, joined

if TYPE_CHECKING:
    from services.run.models import HFModel


def version_0() -> int:
    return 0


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set whose mass reaches top_p. [N, V] -> [N, V]."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = torch.where(mass_before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row with its own generator (exponential race). [N, V] -> [N]."""
    noise = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=g) for g in generators])
    return torch.argmax(probs / noise, dim=-1)


def choose_tokens(logits: torch.Tensor, sampling: SamplingSettings,
                  generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its logprob. [N, V] -> [N], [N].

    Temperature 0 is greedy: the most likely token, its logprob at temperature 1. Otherwise a sample from the
    temperature-scaled, top-p-truncated distribution, its logprob taken before the truncation."""
    if sampling.temperature == 0:
        chosen = torch.argmax(logits, dim=-1)
        return chosen, algos.token_logprobs(logits, chosen, 1.0)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    chosen = sample_rows(top_p_filter(probs, sampling.top_p), generators)
    return chosen, algos.token_logprobs(logits, chosen, sampling.temperature)


def cache_argument(model: HFModel) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache``, or ``past_key_values`` in
    transformers versions without it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine:
    def __init__(self, model: HFModel, pad_id: int, eos_ids: tuple[int, ...], *, batch_size: int):
        self.model = model.eval()
        self.pad_id = pad_id
        self.eos_ids = eos_ids
        self.batch_size = batch_size
        self.cache_argument = cache_argument(model)
        self.base_weights: dict[str, torch.Tensor] = {}  # the base of each layer a LoRA adapter adapts (load_adapter)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, seed_indices: Sequence[int] | None = None,
                 *, before_step: Callable[[], int] = version_0) -> list[list[Completion]]:
        """``sampling.n`` completions for each prompt; prompt i seeds from ``seed_indices[i]`` (default: i).

        ``before_step`` is called before every token step and returns the weight version the step runs under
        (it may swap new weights in first); each completion is stamped with the versions of its first and last
        tokens. It may raise GenerationInterrupted, which drops the work."""
        indices = list(range(len(prompts))) if seed_indices is None else list(seed_indices)
        rows = [(i, k) for i in range(len(prompts)) for k in range(sampling.n)]
        done: dict[tuple[int, int], Completion] = {}
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            generators = [
                torch.Generator().manual_seed(hash_seed(sampling.seed, indices[i], k)) for i, k in chunk
            ]
            outputs = self._generate_rows([prompts[i] for i, _ in chunk], generators, sampling=sampling,
                                          before_step=before_step)
            done.update(zip(chunk, outputs))
        return [[done[(i, k)] for k in range(sampling.n)] for i in range(len(prompts))]

    def _generate_rows(
        self, prompts: list[list[int]], generators: list[torch.Generator], sampling: SamplingSettings,
        *, before_step: Callable[[], int] = version_0,
    ) -> list[Completion]:
        recorder = RouteRecorder(self.model) if sampling.routed_experts else None
        try:
            return self._sample_rows(prompts, generators, sampling=sampling, before_step=before_step,
                                     recorder=recorder)
        finally:
            if recorder is not None:
                recorder.close()

    @torch.no_grad()
    def _sample_rows(
        self, prompts: list[list[int]], generators: list[torch.Generator], sampling: SamplingSettings,
        *, before_step: Callable[[], int], recorder: RouteRecorder | None,
    ) -> list[Completion]:
        """Sample ``prompts`` together, a row each, left-padded; with a ``recorder``, each row's routes of the
        tokens it fed the model: its prompt's, then each sampled token's but the last (never fed)."""
        stops = torch.tensor(sorted(set(self.eos_ids) | set(sampling.stop_token_ids)), dtype=torch.int64)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):  # left padding, so every row's next token is at the end
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        routes: list[list[torch.Tensor]] = [[] for _ in prompts]  # each row's, of the tokens fed so far
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        last_versions = [0 for _ in prompts]  # the weight version of each row's last token
        finished = torch.zeros(len(prompts), dtype=torch.bool)
        cache = DynamicCache(config=self.model.config)
        step_ids = input_ids
        for step in range(sampling.max_new_tokens):
            version = before_step()
            if step == 0:
                first_version = version  # every row has its first token at this step
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            out = self.model(
                input_ids=step_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                **{self.cache_argument: cache},
            )
            if recorder is not None:
                taken = recorder.take()
                step_routes = taken.view(len(prompts), step_ids.shape[1], *taken.shape[1:])
                for row in torch.nonzero(~finished).flatten().tolist():  # the rows that fed a real token
                    routes[row].append(step_routes[row, -len(prompts[row]):] if step == 0 else step_routes[row])
            logits = out.logits[:, -1].float()
            chosen, chosen_logprobs = choose_tokens(logits, sampling, generators)
            for row in torch.nonzero(~finished).flatten().tolist():
                tokens[row].append(int(chosen[row]))
                logprobs[row].append(float(chosen_logprobs[row]))
                last_versions[row] = version
            finished |= torch.isin(chosen, stops)
            if bool(finished.all()):
                break
            step_ids = torch.where(finished, torch.full_like(chosen, self.pad_id), chosen).unsqueeze(-1)
            attention_mask = torch.cat([attention_mask, (~finished).long().unsqueeze(-1)], dim=-1)
        return [
            Completion(token_ids=t, logprobs=lp, finish_reason="stop" if t and t[-1] in stops.tolist() else "length",
                       first_version=first_version, last_version=last,
                       routed_experts=torch.cat(r) if recorder is not None else None)
            for t, lp, last, r in zip(tokens, logprobs, last_versions, routes)
        ]

    def compute_log_probs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """The logprob (temperature 1) of each response token given the prompt and the response tokens before it."""
        return self.score(prompts, responses, top_k=0)[0]

    @torch.no_grad()
    def score(self, prompts: list[list[int]], responses: list[list[int]],
              top_k: int) -> tuple[list[list[float]], TopTokens | None]:
        """The logprob (temperature 1) of each response token given the prompt and the response tokens before
        it, and with ``top_k`` > 0 the top_k most likely next tokens at each of those positions (all of them, for
        a smaller vocabulary), flat over the responses; one forward pass over the whole sequences, right-padded,
        ``batch_size`` sequences at a time."""
        scored: list[list[float]] = []
        tops: list[TopTokens] = []
        for start in range(0, len(prompts), self.batch_size):
            rows = [p + r for p, r in zip(prompts[start : start + self.batch_size],
                                          responses[start : start + self.batch_size])]
            input_ids = torch.full((len(rows), max(len(row) for row in rows)), self.pad_id, dtype=torch.int64)
            attention_mask = torch.zeros_like(input_ids)
            for index, row in enumerate(rows):
                input_ids[index, : len(row)] = torch.tensor(row)
                attention_mask[index, : len(row)] = 1
            device = self.model.device
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            for index, prompt in enumerate(prompts[start : start + self.batch_size]):
                length = len(rows[index]) - len(prompt)  # the response's tokens, each predicted one position back
                before = logits[index, len(prompt) - 1 : len(prompt) - 1 + length].float()
                targets = input_ids[index, len(prompt) : len(prompt) + length].to(before.device)
                scored.append(algos.token_logprobs(before, targets, 1.0).tolist())
                if top_k > 0:
                    top = torch.log_softmax(before, dim=-1).topk(min(top_k, before.shape[-1]), dim=-1)
                    tops.append(TopTokens(ids=top.indices.cpu(), logprobs=top.values.cpu()))
        return scored, joined(tops) if tops else None

    def shift_weight(self, name: str, delta: float) -> None:
        """Add ``delta`` to every value of parameter ``name``, or of one expert's projection by its checkpoint name
        (``<layer>.mlp.experts.<e>.up_proj.weight``: a view of the fused experts parameter) (a test's deliberately
        wrong weights; KeyError naming it if the model has none)."""
        parameters: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        parameters |= {piece: view for fused, parameter in parameters.items()
                       for piece, view in per_expert_tensors(fused, parameter)}
        if name not in parameters:
            raise KeyError(f"corrupt_weight_after_sync names {name!r}, which is not a parameter of the rollout model")
        with torch.no_grad():
            parameters[name].add_(delta)

    def load_adapter(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Serve a new LoRA adapter (``common.adapters``): each adapted layer's weight becomes its base weight +
        B @ A, the base kept (a copy of each adapted weight, made when it is first adapted); a layer the previous
        adapter adapted and this one does not goes back to its base. Every factor is checked against the model
        before any weight changes, so an adapter refused (WeightsNotLoaded naming why) leaves the previous one
        serving."""
        try:
            pairs = adapter_pairs(named)
        except ValueError as error:
            raise WeightsNotLoaded(str(error)) from None
        weights = {name[: -len(".weight")]: tensor for name, tensor in self.model.named_parameters()
                   if name.endswith(".weight")}
        for module, (a, b) in pairs.items():
            weight = weights.get(module)
            if weight is None or weight.dim() != 2:
                raise WeightsNotLoaded(f"received an adapter of {module!r}, which is not a linear layer of the "
                                       "rollout model")
            if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise WeightsNotLoaded(f"received an adapter of {module} of shape {b.shape[0]} x {a.shape[1]}, "
                                       f"which does not fit its {weight.shape[0]} x {weight.shape[1]} weight")
        with torch.no_grad():
            for module in self.base_weights.keys() - pairs.keys():
                weights[module].copy_(self.base_weights[module])
            for module, (a, b) in pairs.items():
                base = self.base_weights.setdefault(module, weights[module].detach().clone())
                weights[module].copy_(merged_weight(base, a.to(base.device), b.to(base.device)))

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors into the model's parameters and buffers, by name: all of them, or none when one
        does not fit (WeightsNotLoaded naming it: a name the model lacks, another shape)."""
        state = self.model.state_dict()
        for name, tensor in named:
            if name not in state:
                raise WeightsNotLoaded(f"received weight {name!r} is not in the rollout model")
            if state[name].shape != tensor.shape:
                raise WeightsNotLoaded(f"received weight {name!r} has shape {tuple(tensor.shape)}, the rollout "
                                       f"model's {tuple(state[name].shape)}")
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)


class WeightsNotLoaded(ValueError):
    """Received weights that do not fit the model; none of them was copied in."""
