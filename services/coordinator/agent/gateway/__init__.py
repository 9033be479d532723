"""The gateway: a run's OpenAI-compatible endpoint (``/v1/chat/completions``, ``/v1/models``), in the
coordinator's process, through which the agents users already wrote sample from the current policy; each call is a
turn of the agent loop's dispatcher, recorded token-exactly, and an episode's calls become its samples."""
