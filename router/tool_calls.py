"""Tool calling on /v1/chat/completions, as OpenAI's API and vLLM's server define it.

`tools` go to the chat template (transformers' `tools` argument); the history may hold
assistant messages with `tool_calls` (their JSON `arguments` become objects for the template,
as vLLM does) and `tool` messages with `tool_call_id`. `tool_choice`:

* ``none``: plain text;
* ``auto`` (the default with tools): the model decides, and `--tool-call-parser` reads calls
  out of its text (router.tool_parsers); needs `--enable-auto-tool-choice`, as in vLLM;
* ``required``: the output is held by structured output to a JSON array of one or more
  ``{"name", "parameters"}`` (one at most without parallel_tool_calls), vLLM's schema;
* a named function: the output is held to that function's parameters, and is its arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.engine.protocol import StructuredOutputSpec
from pdcluster.router.tool_parsers import PARSERS, ForcedCalls, ToolCallStream


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolCalling:
    """The gateway's flags: --tool-call-parser (a name of router.tool_parsers.PARSERS) and
    --enable-auto-tool-choice."""

    parser: str | None = None
    auto: bool = False


class ToolChoiceError(ValueError):
    """The request's tools and tool_choice do not go together; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


#: an object schema for a function declared without parameters
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output is read. grammar: what structured output holds it to (None:
    free); named: the forced function's name."""

    mode: Literal["auto", "required", "named"]
    grammar: StructuredOutputSpec | None
    parser: str | None = None
    named: str | None = None

    def stream(self) -> ToolCallStream:
        """A fresh reader for one choice."""
        if self.mode == "auto":
            return PARSERS[self.parser]()
        return ForcedCalls(self.named)

    @property
    def finish_reason(self) -> str:
        """A choice that made calls ends with this (OpenAI: "stop" for a named function)."""
        return "stop" if self.mode == "named" else "tool_calls"


def plan(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel: bool | None,
         calling: ToolCalling) -> ToolPlan | None:
    """The plan for a request, None for plain text. Raises ToolChoiceError."""
    param = "tool_choice" if tool_choice is not None else "tools"
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise ToolChoiceError(f"tool_choice {_shown(tool_choice)} needs tools", "tool_choice")
    by_name = {t.function.name: t.function for t in tools}
    if tool_choice == "auto":
        if not (calling.auto and calling.parser):
            raise ToolChoiceError('"auto" tool choice (the default with tools) requires '
                                  "--enable-auto-tool-choice and --tool-call-parser to be set",
                                  param)
        return ToolPlan("auto", None, calling.parser)
    if tool_choice == "required":
        items = {"anyOf": [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": f.parameters or _ANY_OBJECT},
            "required": ["name", "parameters"], "additionalProperties": False}
            for name, f in by_name.items()]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan("required", StructuredOutputSpec("json", json.dumps(schema)))
    name = tool_choice.function.name
    if name not in by_name:
        raise ToolChoiceError(f"tool_choice names the function `{name}`, which is not in "
                              f"tools ({', '.join(sorted(by_name))})", "tool_choice")
    return ToolPlan("named", StructuredOutputSpec(
        "json", json.dumps(by_name[name].parameters or _ANY_OBJECT)), named=name)


def _shown(choice: ToolChoice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"`{choice.function.name}`"


def tool_specs(tools: list[Tool] | None) -> list[tuple[str, StructuredOutputSpec]]:
    """(param, grammar) of each tool's parameters schema, for the gateway's compile check."""
    return [(f"tools[{i}].function.parameters", StructuredOutputSpec("json", json.dumps(
        t.function.parameters))) for i, t in enumerate(tools or ()) if t.function.parameters]


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """`tools` as transformers passes them to a chat template."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict]:
    """A history message's calls for the template, arguments as objects where they parse."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
