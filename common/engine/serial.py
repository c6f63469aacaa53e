"""msgpack for what crosses between the API server and its engine processes (ch09).

vLLM v1 sends its requests and outputs between processes as msgpack
(`vllm/v1/serial_utils.py`: msgspec structs, tensors as extension types).
The course's requests and outputs are plain dataclasses (`SamplingParams`,
`RequestOutput`, `IterationStats`...): msgpack carries ints, floats,
strings, lists and dicts itself, and three extension types carry the rest:

- `OBJECT`: an instance of one of the `CARRIED` classes, as its class's
  index in that list and its attributes (`vars(obj)`), packed again;
- `ENUM`: a member of one of the `CARRIED` enums, as its index and value;
- `TUPLE`: a tuple (plain msgpack would turn it into a list).

Only the classes in `CARRIED` cross: anything else is a `TypeError` when
sent, never an arbitrary object rebuilt on the other side (what pickle
would allow). An instance is rebuilt without calling its `__init__`.

Left out: tensors (nothing the course sends between its processes holds
one), zero-copy buffers, a schema shared with other languages.
"""
from __future__ import annotations

import enum
from typing import Any

import msgpack

from common.engine.admission import Admission
from common.metrics.stats import FinishedRequestStats, IterationStats, PromptTokenStats
from common.layers.sampler import SampledToken
from common.outputs import CompletionOutput, FinishReason, RequestOutput
from common.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# The classes that may cross, by index: append only (both sides share the list).
CARRIED: list[type] = [SamplingParams, StructuredOutputsParams, RequestOutputKind,
                       RequestOutput, CompletionOutput, SampledToken, FinishReason,
                       IterationStats, FinishedRequestStats, Admission, PromptTokenStats]
_INDEX = {cls: i for i, cls in enumerate(CARRIED)}

OBJECT, ENUM, TUPLE = 1, 2, 3  # msgpack extension type codes


def _default(obj: Any) -> msgpack.ExtType:
    """How msgpack packs what it does not know (see the module docstring)."""
    cls = type(obj)
    if cls not in _INDEX:
        if isinstance(obj, tuple):
            return msgpack.ExtType(TUPLE, encode(list(obj)))
        raise TypeError(f"{cls.__name__} does not cross between processes "
                        "(common/engine/serial.py: CARRIED)")
    if isinstance(obj, enum.Enum):
        return msgpack.ExtType(ENUM, encode([_INDEX[cls], obj.value]))
    return msgpack.ExtType(OBJECT, encode([_INDEX[cls], vars(obj)]))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == TUPLE:
        return tuple(decode(data))
    index, payload = decode(data)
    cls = CARRIED[index]
    if code == ENUM:
        return cls(payload)
    obj = object.__new__(cls)
    obj.__dict__.update(payload)  # frozen dataclasses too: no __setattr__ involved
    return obj


def encode(obj: Any) -> bytes:
    # strict_types: a tuple or an enum (a str subclass) goes through _default
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def decode(data: bytes) -> Any:
    # strict_map_key=False: logit_bias's keys are token ids (ints)
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
