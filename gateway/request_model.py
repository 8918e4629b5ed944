"""RequestModel: the base of every JSON request body. It refuses text that is not valid Unicode before any field
is read.

JSON allows `"\udfff"`: a lone UTF-16 surrogate, which Python decodes into a `str` that no UTF-8 encoder accepts.
Left alone it reaches the tokenizer or the database driver and fails there as a 500 (and the failing request
drops its keep-alive connection). Here it is a 400 naming the field, before anything else runs.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, model_validator

from gateway.errors import APIError

_SURROGATE = re.compile("[\ud800-\udfff]")


def find_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """(field path, the offending character as U+XXXX) of the first lone surrogate in a decoded JSON value."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (path, f"U+{ord(found.group()):04X}") if found else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        name = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return name, "a key"
        found = find_surrogate(item, name)
        if found is not None:
            return found
    return None


class RequestModel(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = find_surrogate(data)
        if found is not None:  # an APIError passes through pydantic unchanged, to the 400 handler
            field, where = found
            raise APIError(
                400,
                f"invalid value for '{field}': text holds a lone surrogate ({where}), which is not valid Unicode",
                param=field,
            )
        return data
