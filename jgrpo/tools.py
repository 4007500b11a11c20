"""Tools and environments for multi-turn rollouts: what the model may call, how its calls are
read from its text, how they run, and what it is told back.

A tool is a plain Python function with type hints and a docstring (Google style, an `Args:`
section): `tool_schemas` derives the JSON schema the chat template shows the model
(`tokenizer.apply_chat_template(messages, tools=...)`, transformers' own derivation). A turn's
tool calls are parsed in the format of the model family's chat template (`parse_tool_calls`):

- Qwen2.5 and Qwen3 (model_type qwen2, qwen3): one or more
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks;
- Llama 3.x (model_type llama): the turn is a JSON object `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), or several separated by `;`.

`python` is a built-in tool (a program run in the code rewards' sandbox, its printed output
returned); `parse_tool_spec` reads `task.tools` ("python, my_tools:stock_price").
`run_tool_calls` runs calls, each with a timeout, and returns `tool` messages: a call that names
no tool, has bad arguments, raises or times out becomes an error message to the model (counted
in `ToolResults.errors`), never an exception of the run.

An `Environment` covers what a tool cannot (a game, a multi-step checker): `reset(example)` gives
the conversation's first messages, `step(messages)` answers the model's latest turn with more
messages or ends the episode. `ToolEnvironment` is the environment of a set of tools: it answers
each turn's calls and ends the episode on a turn without one. TRL calls these tools and
environments too; Tunix's agentic learner has agents and environments; verl's agent loop has
tools.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

# model_type of the HF config -> the tool-call format of its chat template
FAMILIES = {"qwen2": "qwen", "qwen3": "qwen", "llama": "llama"}


class ToolFormatError(ValueError):
    """The model family has no tool-call parser; the message names those that do."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None  # set when the call's text was not a valid call


def tool_format(model_type: str) -> str:
    """The tool-call format of a model family (`FAMILIES`); ToolFormatError when it has none."""
    if model_type not in FAMILIES:
        known = ", ".join(f"{name} ({fmt})" for name, fmt in FAMILIES.items())
        raise ToolFormatError(
            f"no tool-call parser for model_type {model_type!r}: its chat template's format "
            f"is not known here. Known: {known}; use an environment that reads the turn's text "
            "itself (jgrpo.tools.Environment) for other families."
        )
    return FAMILIES[model_type]


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """The JSON schema of each tool, as chat templates take them (`tools=`), derived by
    transformers from the type hints and the docstring's `Args:` section."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        try:
            schemas.append(get_json_schema(tool))
        except (
            Exception
        ) as error:  # transformers' DocstringParsingException, TypeHintParsingException
            name = getattr(tool, "__name__", repr(tool))
            raise ToolFormatError(
                f"tool {name}: {error}. A tool needs a type hint on every argument and a "
                "docstring with a description and an `Args:` section naming each argument."
            ) from None
    return schemas


_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The tool calls in one model turn's text, in order (none: a plain answer).

    `fmt` is `tool_format(model_type)`. A call whose text is not valid JSON, or not an object
    with a string "name" and an object of arguments, is returned with `error` set, so the
    model is told what was wrong."""
    if fmt == "qwen":
        return [_call_of(block, "arguments") for block in _QWEN_CALL.findall(text)]
    if fmt == "llama":
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []
        return [_call_of(part, "parameters") for part in _split_json_objects(body)]
    raise ToolFormatError(
        f"unknown tool-call format {fmt!r}; known: {sorted(set(FAMILIES.values()))}"
    )


def _call_of(text: str, arguments_key: str) -> ToolCall:
    """A ToolCall from one call's JSON text; `arguments_key` is where the format puts them
    ("arguments" is accepted in either format)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError as error:
        return ToolCall("", {}, f"the tool call is not valid JSON ({error.msg}): {text[:200]!r}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, f'a tool call needs a string "name": {text[:200]!r}')
    arguments = call.get(arguments_key, call.get("arguments", {}))
    if isinstance(arguments, str):  # some templates emit the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, f"the arguments of {call['name']} must be an object")
    return ToolCall(call["name"], arguments)


def _split_json_objects(text: str) -> list[str]:
    """'{...}; {...}' -> ['{...}', '{...}'] (the separator Llama 3.x uses between calls)."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for index, char in enumerate(text):
        if in_string:
            escaped = char == "\\" and not escaped
            if char == '"' and not escaped:
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                parts.append(text[start : index + 1])
                start = index + 1
        elif depth == 0 and char in ";\n \t":
            start = index + 1
    if start < len(text) and text[start:].strip():
        parts.append(text[start:].strip())  # an unclosed object: reported as invalid JSON
    return parts


@dataclasses.dataclass
class ToolResults:
    """The `tool` messages answering one turn's calls, and how many of them were errors."""

    messages: list[dict[str, str]]
    errors: int


def run_tool_calls(
    calls: Sequence[ToolCall], tools: Mapping[str, Callable], *, timeout_s: float = 30.0
) -> ToolResults:
    """Runs each call (in order, each in a thread given `timeout_s`) and returns one `tool`
    message per call: {"role": "tool", "name": ..., "content": str(result)}. An unknown tool,
    unreadable or wrong arguments, an exception or a timeout gives an error message instead
    ("error: ..."), counted in `errors`. A call that outlives its timeout is abandoned (a
    thread cannot be stopped): tools that run code should run it in
    `jgrpo.rewards.code`'s sandbox, which kills its process."""
    messages, errors = [], 0
    for call in calls:
        content = _run_one(call, tools, timeout_s)
        failed = content.startswith("error: ")
        errors += failed
        messages.append({"role": "tool", "name": call.name, "content": content})
    return ToolResults(messages, errors)


def _run_one(call: ToolCall, tools: Mapping[str, Callable], timeout_s: float) -> str:
    if call.error is not None:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(tools)}"
    tool = tools[call.name]
    try:
        inspect.signature(tool).bind(**call.arguments)
    except TypeError as error:
        return f"error: bad arguments for {call.name}: {error}"
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jgrpo-tool")
    try:
        result = pool.submit(tool, **call.arguments).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return f"error: {call.name} did not answer within {timeout_s:g} s"
    except Exception as error:  # the tool's own failure, told to the model
        return f"error: {call.name} raised {type(error).__name__}: {error}"
    finally:
        pool.shutdown(wait=False)
    return result if isinstance(result, str) else json.dumps(result, default=str)


class Environment(Protocol):
    """What a multi-turn episode answers to. `reset` gives the conversation's first messages for
    an example (e.g. its prompt); `step` gets the conversation so far, the model's latest turn
    last ({"role": "assistant", "content": text}), and returns the messages that answer it
    (appended as context the model reads but is not trained on) and whether the episode ends."""

    def reset(self, example: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, messages: Sequence[Mapping[str, Any]]) -> EnvironmentStep: ...


@dataclasses.dataclass
class EnvironmentStep:
    messages: list[dict[str, Any]]  # the answer to the model's turn (e.g. tool messages)
    done: bool  # the episode ends: no more turns
    tool_calls: int = 0  # calls the turn made (metrics)
    tool_errors: int = 0  # of which failed (metrics)


class ToolEnvironment:
    """The environment of a set of tools: each turn's tool calls are run and answered with
    `tool` messages; a turn without a call ends the episode (it is the model's answer)."""

    def __init__(self, tools: Sequence[Callable], model_type: str, *, timeout_s: float = 30.0):
        self.tools = {tool.__name__: tool for tool in tools}
        self.schemas = tool_schemas(tools)
        self.format = tool_format(model_type)
        self.timeout_s = timeout_s

    def reset(self, example: Mapping[str, Any]) -> list[dict[str, Any]]:
        prompt = example["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, messages: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        calls = parse_tool_calls(str(messages[-1]["content"]), self.format)
        if not calls:
            return EnvironmentStep([], done=True)
        results = run_tool_calls(calls, self.tools, timeout_s=self.timeout_s)
        return EnvironmentStep(results.messages, False, len(calls), results.errors)


def python(code: str) -> str:
    """Runs a Python program and returns what it printed.

    Args:
        code: the program's source; print what you want to see
    """
    from jgrpo.rewards.sandbox import run_python

    result = run_python(code, timeout_s=PYTHON_TIMEOUT_S)
    if result.timed_out:
        return f"error: the program ran longer than {PYTHON_TIMEOUT_S:g} s"
    if not result.ok:
        lines = result.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit status {result.returncode}")
    return result.stdout


PYTHON_TIMEOUT_S = 5.0  # the sandbox kills a program that runs longer


def builtin_tools() -> dict[str, Callable]:
    """Every built-in tool by its config name (`task.tools`)."""
    return {"python": python}


def parse_tool_spec(spec: str) -> list[Callable]:
    """'python, my_tools:stock_price' -> the tools: built-in names, or your own functions by
    import path `module:function` (found in the current directory or on PYTHONPATH)."""
    from jgrpo.rewards.registry import RewardSpecError, _import_reward

    known, tools = builtin_tools(), []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part in known:
            tools.append(known[part])
            continue
        if ":" not in part:
            raise ToolFormatError(
                f"unknown tool {part!r} in task.tools={spec!r}; built-in tools: "
                f"{', '.join(known)}; or your own function as module:function."
            )
        try:
            tools.append(_import_reward(part, what="tool")[1])
        except RewardSpecError as error:
            raise ToolFormatError(f"task.tools: {error}") from None
    if not tools:
        raise ToolFormatError(f"task.tools={spec!r} names no tool; e.g. 'python'.")
    names = [tool.__name__ for tool in tools]
    if len(set(names)) < len(names):
        raise ToolFormatError(f"task.tools={spec!r} names two tools alike: {names}.")
    return tools
