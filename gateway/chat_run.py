"""Running a chat request (the chat endpoint's, or one another API's body was made into: gateway.messages_api,
gateway.responses_api): its place in the queue, its prompt rendered off the event loop and checked against the
context, then the exchange with the endpoint that shapes the answer in that API's form."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from gateway import errors
from gateway.api import ChatCompletionRequest, chat_tools
from gateway.embeddings import require_task
from gateway.exchange import AnyEndpoint, respond
from gateway.state import Gateway
from gateway.text import PromptError
from gateway.validation import token_limit


def encode(gateway: Gateway, chat: ChatCompletionRequest) -> list[int]:
    """The chat's prompt: the model's template over its messages and tools, truncated as asked."""
    prompt = gateway.tokenizer.encode_chat(
        [m.for_template() for m in chat.messages],
        chat.add_generation_prompt,
        tools=chat_tools(chat.tools),
        add_special_tokens=chat.add_special_tokens,
    )
    return chat.truncate(prompt, gateway.max_model_len)


async def count_tokens(gateway: Gateway, chat: ChatCompletionRequest, param: str) -> int:
    try:
        return len(await gateway.off_loop(encode, gateway, chat))
    except PromptError as exc:
        raise errors.invalid_request(str(exc), param=param) from None


async def run_chat(
    gateway: Gateway,
    request: Request,
    chat: ChatCompletionRequest,
    endpoint: Callable[[list[int]], AnyEndpoint],
    param: str,
) -> Response:
    """Answer `chat` with the endpoint made for its prompt; `param` names the field a bad prompt came from."""
    gateway.check_model(chat.model)
    require_task(gateway, "generate")  # an embedding server refuses every generating API alike
    admission = contextlib.ExitStack()
    admission.enter_context(gateway.admitted(chat.n))
    try:
        prompt = await gateway.off_loop(encode, gateway, chat)
        limit = token_limit(gateway, prompt, chat.token_limit, param)
    except PromptError as exc:
        admission.close()
        raise errors.invalid_request(str(exc), param=param) from None
    except BaseException:
        admission.close()
        raise
    return await respond(gateway, request, endpoint(prompt), [prompt], [limit], admission)
