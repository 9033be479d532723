"""Tables for a terminal: a header row and columns as wide as their widest cell, two spaces apart."""

from __future__ import annotations

from services.coordctl.control import ServiceEntry

SERVICE_COLUMNS = ("HOST", "KIND", "GROUP", "ADDRESS", "GPU", "VERSION", "WEIGHTS", "SEEN", "STATE", "ID")


def aligned(header: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[str, ...] = ()) -> list[str]:
    """The header and the rows as lines, each column padded to its widest cell (those named in ``right``
    aligned to the right), the last column left unpadded."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = []
    for row in (header, *rows):
        cells = [cell.rjust(width) if name in right else cell.ljust(width)
                 for name, cell, width in zip(header, row, widths)]
        lines.append("  ".join(cells).rstrip())
    return lines


def service_rows(entries: list[ServiceEntry]) -> list[tuple[str, ...]]:
    """One row of SERVICE_COLUMNS per service, by host, kind and address; "?" where a service older than
    the field did not say, "-" for no weights."""
    return [(entry.hostname or "?", entry.kind, entry.group, entry.address, entry.gpu or "?",
             entry.meshrl_version or "?", "-" if entry.weight_version is None else str(entry.weight_version),
             f"{entry.last_seen_s:.1f} s", entry.state, entry.service_id)
            for entry in sorted(entries, key=lambda e: (e.hostname, e.kind, e.address))]


def algorithm_lines(coordinator: str, adv_estimators: list[str], entries: list[ServiceEntry]) -> list[str]:
    """What each service registered: the coordinator's advantage estimators (algorithm.adv_estimator) and each
    trainer's policy losses (actor_rollout_ref.actor.policy_loss.loss_mode)."""
    lines = [f"advantage estimators (coordinator {coordinator}): {', '.join(adv_estimators) or '?'}"]
    lines += [f"policy losses (trainer {entry.address}): {', '.join(entry.policy_losses) or '?'}"
              for entry in sorted(entries, key=lambda e: (e.hostname, e.address)) if entry.kind == "trainer"]
    return lines
