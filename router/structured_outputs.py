"""The structured-output fields of a request (OpenAI's `response_format`, vLLM's
`structured_outputs`) as the engine's grammar spec, checked before any worker sees it.

OpenAI: `{"type": "json_object"}` asks for any JSON object, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` for JSON valid under the schema. vLLM's
`structured_outputs` names one of `json`, `regex`, `choice`, `grammar`, `json_object`,
`structural_tag` (vllm/sampling_params.py: StructuredOutputsParams).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.engine.core.structured_output import StructuredOutputManager
from pdcluster.engine.protocol import StructuredOutputSpec
from pdcluster.engine.tokenizer import Tokenizer


class JSONSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object,
    structural_tag. whitespace_pattern: the whitespace JSON may hold between tokens (default:
    none); disable_any_whitespace: vLLM's switch for the same (true is this server's default);
    disable_fallback: accepted, there is one grammar backend."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None


#: whitespace vLLM allows between JSON tokens when any whitespace is asked for
_ANY_WHITESPACE = r"[\x20\x0A\x0D\x09]+"


def spec_of(response_format: ResponseFormat | None,
            structured_outputs: StructuredOutputsParams | None) -> StructuredOutputSpec | None:
    """The grammar a request asks for, None for free text. Raises ValueError (a 400) when the
    request asks for more than one, or json_schema has no schema."""
    specs = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            specs.append(StructuredOutputSpec("json", '{"type": "object"}'))
        elif response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        else:
            specs.append(StructuredOutputSpec("json",
                                              json.dumps(response_format.json_schema.schema_)))
    so = structured_outputs
    if so is not None:
        whitespace = so.whitespace_pattern if so.whitespace_pattern is not None else (
            _ANY_WHITESPACE if so.disable_any_whitespace is False else None)
        if so.json_ is not None:
            text = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            specs.append(StructuredOutputSpec("json", text, whitespace))
        if so.json_object:
            specs.append(StructuredOutputSpec("json", '{"type": "object"}', whitespace))
        if so.regex is not None:
            specs.append(StructuredOutputSpec("regex", so.regex))
        if so.choice is not None:
            specs.append(StructuredOutputSpec("choice", json.dumps(so.choice)))
        if so.grammar is not None:
            specs.append(StructuredOutputSpec("grammar", so.grammar))
        if so.structural_tag is not None:
            tag = so.structural_tag
            specs.append(StructuredOutputSpec(
                "structural_tag", tag if isinstance(tag, str) else json.dumps(tag)))
    if len(specs) > 1:
        raise ValueError("ask for one structured output: response_format or one field of "
                         "structured_outputs (json, regex, choice, grammar, json_object, "
                         "structural_tag)")
    return specs[0] if specs else None


class GrammarCheck:
    """Compiles a request's grammar at the gateway, so a spec the workers could not compile is
    a 400 before any worker sees it. The tokenizer is loaded for it on first use."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @cached_property
    def _manager(self) -> StructuredOutputManager:
        return StructuredOutputManager(self._tokenizer, self._tokenizer.vocab_size)

    def check(self, spec: StructuredOutputSpec) -> None:
        """Raises GrammarError naming the problem."""
        self._manager.validate(spec)

