"""The lookup tool of the local multi-turn example (examples/local_tools.yaml): a user tool, loaded by the env
service from examples/local_tools/tools.yaml as ``lookup.py:LookupTool`` (a path beside the tool config).

It knows the code of every key, a keyed hash that the prompt does not give away: the crc32 of the salt and the
key, modulo 10,000, as four digits (services/coordctl/synthetic.py's lookup task asks for the same codes).
"""

from __future__ import annotations

import re
import zlib

KEY = re.compile(r"[A-Z]{1,8}")


class LookupTool:
    """Arguments ``{"key": "QX"}``: replies with the key's code, e.g. "0423". A missing or malformed key is an
    error (the env service sends the model an error reply)."""

    def __init__(self, config: dict, create_kwargs: dict):
        self.salt = str(config["salt"])

    def call(self, arguments: dict) -> str:
        key = arguments.get("key")
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise ValueError(f'"key" must be 1 to 8 capital letters, got {key!r}')
        return f"{zlib.crc32((self.salt + key).encode()) % 10_000:04d}"
