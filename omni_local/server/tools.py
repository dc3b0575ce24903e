"""A request's tools (`tools`, `tool_choice`, `parallel_tool_calls`) as the protocol's `ToolUse`, and
its messages' tool calls and results checked against each other; a fault is a 400 naming its field."""

from omni_local.errors import RequestError
from omni_local.protocol.functions import Tool, ToolCall
from omni_local.protocol.messages import Message
from omni_local.protocol.tools import FunctionChoice, ToolChoice, ToolUse
from omni_local.server.errors import ApiError
from omni_local.server.schemas import ChatRequest, FunctionTool, MessageToolCall


def tool_use(body: ChatRequest) -> ToolUse | None:
    """What the request offers, or None if it offers no tools (and asks for no call)."""
    tools = tuple(_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools or []))
    choice: ToolChoice = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = FunctionChoice(choice.function.name)
    if not tools and choice == "auto":
        return None
    try:
        return ToolUse(tools, choice, body.parallel_tool_calls is not False)
    except RequestError as error:
        field = str(error).partition(":")[0]  # ToolUse's messages begin with the field at fault
        raise ApiError(400, str(error), param=field) from None


def _tool(tool: FunctionTool, at: str) -> Tool:
    function = tool.function
    try:
        if function.parameters is None:
            return Tool(function.name, function.description or "")
        return Tool(function.name, function.description or "", function.parameters)
    except RequestError as error:
        raise ApiError(400, f"{at}.function: {error}", param=f"{at}.function") from None


def tool_calls(calls: list[MessageToolCall], at: str) -> tuple[ToolCall, ...]:
    """An assistant message's calls, each with its id, name and arguments (a JSON object's text)."""
    read = []
    for index, call in enumerate(calls):
        try:
            read.append(ToolCall(call.id, call.function.name, call.function.arguments))
        except RequestError as error:
            raise ApiError(400, f"{at}[{index}]: {error}", param=f"{at}[{index}]") from None
    return tuple(read)


def check_results(messages: list[Message]) -> None:
    """Each tool message answers a call that an assistant message before it made."""
    made: set[str] = set()
    for index, message in enumerate(messages):
        made |= {call.id for call in message.tool_calls}
        if message.role == "tool" and message.tool_call_id not in made:
            at = f"messages[{index}].tool_call_id"
            raise ApiError(400, f"{at}: no assistant message before it made the call {message.tool_call_id!r}",
                           param=at)
