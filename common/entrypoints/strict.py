"""The strict base of the request models (ch01): OpenAI's types, no coercion.

- `StrictModel`: `"max_tokens": "8"` or `true` is a 400, not 8 or 1; no
  NaN or infinity for a number; unknown fields ignored, as OpenAI and
  vLLM do;
- `Text`: valid Unicode (a lone UTF-16 surrogate such as "\\ud800" is
  refused here, before a tokenizer fails on it);
- `unsupported`: the 400 for a field that OpenAI has and this server does
  not implement.

The request models themselves are common/entrypoints/protocol.py and
common/entrypoints/response_format.py.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1  # a seed is a 64-bit integer (torch.Generator)


def unsupported(message: str) -> PydanticCustomError:
    """A 400 for a field OpenAI has and this server does not implement."""
    return PydanticCustomError("unsupported", message)


# ----------------------------------------------------------------- text
def valid_unicode(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"): not text, and no
    tokenizer can encode it. Refuse it here, with the field's name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode", "contains {char} at position {position}: a lone UTF-16 "
            "surrogate is not valid Unicode text",
            {"char": repr(text[exc.start]), "position": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]


# ---------------------------------------------------------------- requests
class StrictModel(BaseModel):
    """Strict types as OpenAI's (no "8" for 8, no true for 1, no NaN or
    infinity for a number); unknown fields ignored."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
