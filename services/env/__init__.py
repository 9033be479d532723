"""The env service: environments and tools for multi-turn rollouts, one sandboxed worker process per open episode."""
