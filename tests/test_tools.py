"""Tools for multi-turn rollouts: schemas from type hints, calls parsed per model family, calls
run with timeouts and errors told to the model, the tool environment's turns."""

import time

import pytest

from jgrpo import tools as tools_module
from jgrpo.tools import (
    ToolCall,
    ToolEnvironment,
    ToolFormatError,
    parse_tool_calls,
    parse_tool_spec,
    python,
    run_tool_calls,
    tool_format,
    tool_schemas,
)

TABLE = {"ada": 36, "grace": 85}


def lookup(name: str) -> int:
    """The age of a person in the table.

    Args:
        name: the person's first name, lower case
    """
    return TABLE[name]


def add(a: int, b: int = 0) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleeps, then answers.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "done"


TOOLS = {"lookup": lookup, "add": add, "slow": slow}


def test_schemas_come_from_type_hints_and_docstrings():
    (schema,) = tool_schemas([add])
    function = schema["function"]
    assert schema["type"] == "function" and function["name"] == "add"
    assert function["description"] == "Adds two numbers."
    assert function["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first number"},
        "b": {"type": "integer", "description": "the second number"},
    }
    assert function["parameters"]["required"] == ["a"]


def test_a_tool_without_hints_or_docs_is_an_error_naming_it():
    def undocumented(x):
        return x

    with pytest.raises(ToolFormatError, match="tool undocumented: .*type hint on every argument"):
        tool_schemas([undocumented])


def test_families_and_a_clear_error_for_one_without_a_parser():
    assert [tool_format(t) for t in ("qwen2", "qwen3", "llama")] == ["qwen", "qwen", "llama"]
    with pytest.raises(ToolFormatError, match="no tool-call parser for model_type 'gemma3'"):
        tool_format("gemma3")


def test_qwen_calls_are_the_tool_call_blocks_of_the_turn():
    text = (
        "Let me look both up.\n<tool_call>\n"
        '{"name": "lookup", "arguments": {"name": "ada"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}\n</tool_call>'
    )
    assert parse_tool_calls(text, "qwen") == [
        ToolCall("lookup", {"name": "ada"}),
        ToolCall("add", {"a": 2, "b": 3}),  # arguments given as a JSON string
    ]
    assert parse_tool_calls("The answer is 36.", "qwen") == []
    (broken,) = parse_tool_calls('<tool_call>{"name": "lookup", </tool_call>', "qwen")
    assert broken.error.startswith("the tool call is not valid JSON")


def test_llama_calls_are_a_json_turn_or_several_separated_by_semicolons():
    single = '<|python_tag|>{"name": "lookup", "parameters": {"name": "grace"}}'
    assert parse_tool_calls(single, "llama") == [ToolCall("lookup", {"name": "grace"})]
    several = (
        '{"name": "add", "parameters": {"a": 1}}; {"name": "lookup", "parameters": {"name": "a;}"}}'
    )
    assert parse_tool_calls(several, "llama") == [
        ToolCall("add", {"a": 1}),
        ToolCall("lookup", {"name": "a;}"}),  # separators inside strings stay
    ]
    assert parse_tool_calls("Grace is 85.", "llama") == []
    (nameless,) = parse_tool_calls('{"parameters": {}}', "llama")
    assert nameless.error.startswith('a tool call needs a string "name"')


def test_calls_run_and_every_failure_becomes_an_error_message_for_the_model():
    calls = [
        ToolCall("lookup", {"name": "ada"}),
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("lookup", {"name": "alan"}),  # raises KeyError
        ToolCall("missing", {}),
        ToolCall("add", {"c": 1}),
        ToolCall("slow", {"seconds": 5}),
        ToolCall("", {}, "the tool call is not valid JSON (x)"),
    ]
    results = run_tool_calls(calls, TOOLS, timeout_s=0.2)
    contents = [message["content"] for message in results.messages]
    assert contents[:2] == ["36", "5"]
    assert contents[2] == "error: lookup raised KeyError: 'alan'"
    assert contents[3] == "error: no tool named 'missing'; the tools are lookup, add, slow"
    assert contents[4].startswith("error: bad arguments for add: ")
    assert contents[5] == "error: slow did not answer within 0.2 s"
    assert contents[6] == "error: the tool call is not valid JSON (x)"
    assert results.errors == 5
    assert [m["role"] for m in results.messages] == ["tool"] * 7
    assert results.messages[0]["name"] == "lookup"


def test_the_tool_environment_answers_calls_and_ends_on_a_plain_answer():
    env = ToolEnvironment([lookup, add], "qwen2")
    messages = env.reset({"prompt": "How old is Ada?", "answer": "36"})
    assert messages == [{"role": "user", "content": "How old is Ada?"}]
    assert [schema["function"]["name"] for schema in env.schemas] == ["lookup", "add"]
    call = '<tool_call>\n{"name": "lookup", "arguments": {"name": "ada"}}\n</tool_call>'
    turn = env.step([*messages, {"role": "assistant", "content": call}])
    assert not turn.done and (turn.tool_calls, turn.tool_errors) == (1, 0)
    assert turn.messages == [{"role": "tool", "name": "lookup", "content": "36"}]
    answer = env.step([*messages, {"role": "assistant", "content": "Ada is 36."}])
    assert answer.done and answer.messages == [] and answer.tool_calls == 0


def test_the_python_tool_runs_programs_in_the_sandbox(monkeypatch):
    """Printed output comes back; an exception or a timeout becomes an error message."""
    calls = [
        ToolCall("python", {"code": "print(sum(range(10)))"}),
        ToolCall("python", {"code": "print(1 / 0)"}),
        ToolCall("python", {"code": "import time\ntime.sleep(30)"}),
    ]
    monkeypatch.setattr(tools_module, "PYTHON_TIMEOUT_S", 1.0)
    results = run_tool_calls(calls, {"python": python}, timeout_s=20)
    contents = [message["content"] for message in results.messages]
    assert contents[0] == "45\n"
    assert contents[1] == "error: python raised RuntimeError: ZeroDivisionError: division by zero"
    assert contents[2] == "error: the program ran longer than 1 s"
    assert results.errors == 2
    (schema,) = tool_schemas([python])
    assert schema["function"]["parameters"]["required"] == ["code"]


def test_tool_specs_name_built_in_tools_or_import_paths(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        "def stock_price(symbol: str) -> float:\n"
        '    """The last price.\n\n    Args:\n        symbol: the ticker\n    """\n'
        "    return 12.5\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = parse_tool_spec("python, my_tools:stock_price")
    assert [tool.__name__ for tool in tools] == ["python", "stock_price"]
    with pytest.raises(ToolFormatError, match="unknown tool 'calculator'.*built-in tools: python"):
        parse_tool_spec("calculator")
    with pytest.raises(ToolFormatError, match="tool 'my_tools:nothing'.*has no 'nothing'"):
        parse_tool_spec("my_tools:nothing")
    with pytest.raises(ToolFormatError, match="names two tools alike"):
        parse_tool_spec("python, python")
