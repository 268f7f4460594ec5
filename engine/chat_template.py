"""A chat template given by the user (`kvllm serve --chat-template`, `Engine.chat(chat_template=...)`): a file path
or the Jinja template itself, told apart by vLLM's rule: a value that opens as a file is read from it; one that does
not open and contains none of ``{``, ``}`` or a newline looks like a mistyped path and is an error; anything else is
the template text.
"""
from __future__ import annotations

from pathlib import Path

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | Path | None) -> str | None:
    """The template text for `value` (None stays None). Raises ValueError naming a path that cannot be read."""
    if value is None:
        return None
    try:
        with open(Path(value).expanduser(), encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        if isinstance(value, Path) or not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"chat_template={str(value)!r} looks like a file path, but it cannot be read: "
                             f"{err.strerror or err}") from None
        return value
    except ValueError as err:  # e.g. a path with a NUL byte: it is no path, so it must be the template
        if isinstance(value, Path):
            raise ValueError(f"chat_template={str(value)!r}: {err}") from None
        return value
