"""Tool calling without a parser: ``tool_choice: "required"`` or a named function.

A model-specific parser (vLLM's ``--tool-call-parser hermes`` and friends) reads tool
calls out of whatever text the model wrote, in its own format. When the request *forces*
a call, no parser is needed: the output is constrained to the call's JSON, as vLLM does
for these two modes (vLLM's ``_get_json_schema_from_tool``), so even a 135M model cannot
write a call that does not parse:

- a named function: the output is that function's arguments, a JSON object valid under
  its ``parameters`` schema;
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``,
  one or more calls (exactly one with ``parallel_tool_calls: false``), each naming one of
  the tools with arguments valid under that tool's schema.

``"auto"`` (the default when tools are given) lets the model choose between text and a
call: telling them apart needs the model's own format, so it is refused with a 400 that
says so. ``"none"``: the tools are ignored, plain text comes back.
"""

from __future__ import annotations

import json
import uuid

from minivllm.sampling_params import StructuredOutputsParams

# A function declared without parameters takes none: an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_constraint(tools, tool_choice, parallel_tool_calls) -> StructuredOutputsParams | None:
    """The JSON schema a forced tool call must follow, or None when the request does not
    force one. ValueError naming ``tool_choice`` or ``tools`` for what cannot be served."""
    if tool_choice == "none" or (tools is None and tool_choice is None):
        return None
    if not tools:
        raise ValueError(f"tool_choice {_show(tool_choice)} needs tools, and none were given")
    if tool_choice in (None, "auto"):
        raise ValueError(
            'tool_choice "auto" (the default when tools are given) needs a parser for this '
            "model's own tool-call format, which minivllm does not have; use "
            '"required" or name a function to have the output constrained to a call'
        )
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools must have distinct function names, got {names}")
    if tool_choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": tool.function.parameters or _NO_PARAMETERS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    name = tool_choice.function.name
    if name not in names:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools {names}")
    tool = tools[names.index(name)]
    return StructuredOutputsParams(json=tool.function.parameters or _NO_PARAMETERS)


def _show(tool_choice) -> str:
    return json.dumps(tool_choice) if isinstance(tool_choice, str) else "(a named function)"


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_tool_calls(text: str, tool_choice) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` per call in a constrained output, or None if the text is
    not a complete call (the output was cut by ``max_tokens``: it comes back as text)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if tool_choice == "required":
        return [
            (call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value
        ]
    return [(tool_choice.function.name, text)]  # the arguments as written (and streamed)


def forces_tool_call(tools, tool_choice) -> bool:
    return bool(tools) and (tool_choice == "required" or not isinstance(tool_choice, str | None))
