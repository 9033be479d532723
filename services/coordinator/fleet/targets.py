"""Where a run's reward or env services come from, and where a swap (``coordctl reward set``, ``coordctl env set``)
sends them: every service of the kind up in a group, or the one service at an address."""

from __future__ import annotations

from dataclasses import dataclass

from services.coordinator.registry import Registry


@dataclass(frozen=True)
class ServiceTarget:
    """Every service of a run's kind up in a group, or one address."""

    kind: str  # group or address
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


def named_target(group: str, address: str) -> ServiceTarget:
    """The target a swap names: exactly one of ``group`` and ``address``; ValueError otherwise."""
    if (group == "") == (address == ""):
        raise ValueError("name exactly one of group or address")
    return ServiceTarget("group", group) if group else ServiceTarget("address", address)


def target_addresses(registry: Registry, service_kind: str, target: ServiceTarget) -> list[str]:
    """The addresses of ``target``'s services of ``service_kind`` (reward, env) up now; an address target is taken
    as it is (the service there may not register)."""
    if target.kind == "address":
        return [target.name]
    return [record.address for record in registry.up(service_kind, target.name)]
