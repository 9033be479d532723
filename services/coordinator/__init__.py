"""The coordinator service: one per cluster; its registry, its runs and their loops. The wings below stand on
each other top to bottom (runs, step, agent, fleet); what they all stand on is the package's top: the servicer
(``server.py``, the entry), settings, store, registry, waiting, disk, telemetry, config."""
