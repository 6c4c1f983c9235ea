"""The agent loop's pieces without a model: calculator, tool-call parsing, schemas, tool resolution."""

from __future__ import annotations

import pytest
from verity.rollout.agent.calculator import Calculator, evaluate_expression, format_number
from verity.rollout.agent.config import AgentConfig, ToolConfig
from verity.rollout.agent.parsers import TOOL_PARSERS, parse_hermes, register_tool_parser
from verity.rollout.agent.tool_schema import ToolSchema, argument_problems
from verity.rollout.agent.tools import ToolError, resolve_tools, row_tool_kwargs

# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "answer"),
    [
        ("12*34", "408"),
        ("(3+4)*5 - 6", "29"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("2**10", "1024"),
        ("1/3", "0.333333333333"),
        ("sqrt(16) + abs(-2)", "6"),
        ("max(3, 9, 4) - min(2, 5)", "7"),
        ("round(2.675, 2)", "2.67"),
        ("123456789 * 987654321", "121932631112635269"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression: str, answer: str) -> None:
    assert Calculator().execute({"expression": expression}) == answer


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unknown function"),
        ("().__class__", "unsupported syntax"),
        ("open('/etc/passwd')", "unknown function"),
        ("x + 1", "unknown name 'x'"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("2 ^ 3", "use ** for powers"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9**9**9", "more than 100 digits"),
        ("10**200", "more than 100 digits"),
        ("2.0**5000", "more than 100 digits"),
        ("2.5**5000.5", "too large"),
        ("(-8)**0.5", "not a real number"),
        ("sqrt(-1)", "sqrt()"),
        ("lambda: 1", "unsupported syntax"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty expression"),
        ("1+" * 200 + "1", "longer than 256"),
        ("max(1, 2, key=3)", "positional arguments only"),
    ],
)
def test_the_calculator_refuses_anything_else_with_a_message(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        evaluate_expression(expression)


def test_calculator_limits_are_settings() -> None:
    with pytest.raises(ToolError, match="more than 5 digits"):
        Calculator({"max_digits": 5}).execute({"expression": "999*999"})
    assert Calculator({"max_digits": 6}).execute({"expression": "999*999"}) == "998001"
    with pytest.raises(ValueError, match="unknown setting"):
        Calculator.check_config({"digits": 3}, 10.0)
    assert format_number(1e20) == "1e+20"


# ---------------------------------------------------------------- parsing


def test_hermes_reads_calls_and_reports_malformed_ones() -> None:
    text = (
        'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'
        "<tool_call>unclosed"
    )
    turn = parse_hermes(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "1+2"}),
        ("python", {"code": "print(1)"}),
    ]
    assert len(turn.errors) == 4
    assert "not valid JSON" in turn.errors[0]
    assert "no 'name'" in turn.errors[1]
    assert "must be a JSON object" in turn.errors[2]
    assert "not closed" in turn.errors[3]
    assert turn.attempted == 6
    assert parse_hermes("The answer is 3.").attempted == 0


def test_parsers_are_a_registry() -> None:
    def shout(text: str):
        return parse_hermes(text.replace("[[", "<tool_call>").replace("]]", "</tool_call>"))

    register_tool_parser("test-brackets", shout)
    try:
        turn = TOOL_PARSERS.get("test-brackets")('[[{"name": "a", "arguments": {}}]]')
        assert [c.name for c in turn.calls] == ["a"]
    finally:
        TOOL_PARSERS._entries.pop("test-brackets")
        TOOL_PARSERS._canonical.pop("test-brackets")
    with pytest.raises(ValueError, match="tool_parser: unknown tool-call parser 'nope'; known"):
        AgentConfig(tool_parser="nope").validate()


# ---------------------------------------------------------------- schemas and tools


def test_openai_schemas_parse_and_arguments_are_checked() -> None:
    schema = ToolSchema.from_openai(
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "find",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "k": {"type": "integer"},
                        "mode": {"type": "string", "enum": ["fast", "exact"]},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["query"],
                    "additionalProperties": False,
                },
            },
        }
    )
    assert schema.name == "search" and schema.to_openai()["function"]["name"] == "search"
    params = schema.parameters
    assert argument_problems({"query": "a", "k": 3, "mode": "fast", "tags": ["x"]}, params) == []
    assert argument_problems({"query": "a", "k": 3.0}, params) == []  # a whole float is an integer
    problems = argument_problems({"k": True, "mode": "slow", "tags": [1], "other": 1}, params)
    assert "arguments.query: required" in problems
    assert any("unexpected ['other']" in p for p in problems)
    assert "arguments.k: expected integer, got bool" in problems
    assert any(p.startswith("arguments.mode: expected one of") for p in problems)
    assert "arguments.tags[0]: expected string, got int" in problems
    for bad, message in [
        ({"function": {"name": "1x"}}, "function.name"),
        ({"function": {"name": "a", "parameters": {"type": "array"}}}, "must be an 'object'"),
        (
            {"function": {"name": "a", "parameters": {"properties": {}, "required": ["q"]}}},
            "not in properties",
        ),
        ({"type": "retrieval", "function": {"name": "a"}}, "expected 'function'"),
        (
            {"function": {"name": "a", "parameters": {"properties": {"q": {"type": "str"}}}}},
            "expected one of",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            ToolSchema.from_openai(bad)


ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
}


def test_tools_resolve_from_builtin_names_and_import_paths() -> None:
    agent = AgentConfig(
        enabled=True,
        tools=[
            ToolConfig(class_name="calculator"),
            ToolConfig(class_name="python", config={"wall_s": 2.0}, timeout_s=5),
            ToolConfig(class_name="helpers.agent_plugin:echo_tool", tool_schema=ECHO_SCHEMA),
            ToolConfig(class_name="verity.rollout.agent.calculator.Calculator", tool_schema={
                "type": "function", "function": {"name": "calc2", "parameters": {
                    "type": "object", "properties": {"expression": {"type": "string"}}}}}),
        ],
    )  # fmt: skip
    agent.validate()
    specs = resolve_tools(agent)
    assert [s.name for s in specs] == ["calculator", "python", "echo", "calc2"]
    assert [s.timeout_s for s in specs] == [10.0, 5.0, 10.0, 10.0]
    assert specs[0].target == "verity.rollout.agent.calculator:Calculator"


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([], "no tool is declared"),
        ([ToolConfig(class_name="")], "class_name: required"),
        ([ToolConfig(class_name="no_such_module.Tool")], "cannot import"),
        ([ToolConfig(class_name="helpers.agent_plugin:echo_tool")], "tool_schema: required"),
        ([ToolConfig(class_name="helpers.agent_plugin:echo_tool", config={"a": 1}, tool_schema=ECHO_SCHEMA)],
         "takes no settings"),
        ([ToolConfig(class_name="calculator"), ToolConfig(class_name="calculator")], "must be unique"),
        ([ToolConfig(class_name="python", config={"wall_s": 20})], "must be below the tool's timeout"),
        ([ToolConfig(class_name="python", config={"cpu": 1})], "unknown setting"),
        ([ToolConfig(class_name="calculator", timeout_s=0)], "timeout_s: expected > 0"),
    ],
)  # fmt: skip
def test_tool_config_errors_name_the_tool(tools, message) -> None:
    with pytest.raises(ValueError, match=message):
        AgentConfig(enabled=True, tools=tools).validate()


def test_a_verl_tool_config_file_is_read(tmp_path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: calculator\n"
        "    config: {max_digits: 20}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calc\n"
        "        description: arithmetic\n"
        "        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}\n"
    )
    specs = resolve_tools(AgentConfig(enabled=True, tool_config_path=str(path)))
    assert [(s.name, s.config) for s in specs] == [("calc", {"max_digits": 20})]
    path.write_text("tools:\n  - class_name: calculator\n    type: native\n")
    with pytest.raises(ValueError, match=r"tools\[0\]: expected keys"):
        AgentConfig(enabled=True, tool_config_path=str(path)).validate()


def test_row_tool_kwargs_follow_verls_extra_info() -> None:
    extra = {"tools_kwargs": {"echo": {"create_kwargs": {"a": 1, "b": 2}, "execute_kwargs": {"b": 3}}}}
    assert row_tool_kwargs(extra, "echo") == {"a": 1, "b": 3}
    assert row_tool_kwargs(extra, "other") == {}
    assert row_tool_kwargs(None, "echo") == {}


def test_agent_ranges_are_checked() -> None:
    for field, value in [
        ("max_turns", 0),
        ("max_parallel_calls", 0),
        ("tool_workers", -1),
        ("max_turn_tokens", -1),
    ]:
        with pytest.raises(ValueError, match=field):
            AgentConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        AgentConfig(tool_response_truncate_side="both").validate()
    AgentConfig().validate()  # off by default, nothing to resolve
