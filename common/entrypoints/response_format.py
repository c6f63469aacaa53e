"""`response_format` and vLLM's `structured_outputs` (ch07): what the answer must match.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and
vLLM's `structured_outputs` request extra (`json`, `json_object`, `regex`,
`choice`, `grammar`) both become one `StructuredOutputsParams`
(common/sampling_params.py), which the engine compiles with xgrammar
(common/structured_output/manager.py).

Checked here, before anything runs: the shape (a `json_schema` type needs
its `json_schema`, `strict` is a boolean inside it, exactly one
constraint), and a schema's validity against its metaschema (the
`jsonschema` package): `{"type": "objekt"}` is a 400 naming
`response_format.json_schema.schema`. What xgrammar cannot compile (a
regex with a syntax error) is a 400 from the serving code, which
compiles each constraint in a worker thread.

Left out: vLLM's structural tags, `whitespace_pattern` and
`disable_any_whitespace`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

import jsonschema
from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from common.entrypoints.strict import StrictModel, Text, unsupported
from common.sampling_params import StructuredOutputsParams


def valid_json_schema(schema: dict) -> dict:
    """A 400 for a schema that its metaschema refuses ({"type": "objekt"})."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise PydanticCustomError("invalid_json_schema", "is not a valid JSON Schema: {error}",
                                  {"error": exc.message}) from None
    return schema


JsonSchema = Annotated[dict, AfterValidator(valid_json_schema)]


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`."""
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None  # a grammar always holds the schema strictly: accepted as is


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: text, any JSON object, or a JSON schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    strict: bool | None = None  # misplaced: refused below

    @model_validator(mode="after")
    def _shape(self):
        if self.strict is not None:
            raise unsupported("strict belongs in response_format.json_schema, not in "
                              "response_format itself.")
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise unsupported("response_format.json_schema is required when type is "
                              "\"json_schema\", and allowed only then.")
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_)
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return None


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` request extra: exactly one constraint."""
    json_: Union[JsonSchema, Text, None] = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        self.params()  # raises for none or several
        return self

    def params(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(
                json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                choice=tuple(self.choice) if self.choice is not None else None,
                grammar=self.grammar)
        except ValueError as exc:
            raise unsupported(str(exc)) from None
