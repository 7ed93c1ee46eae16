"""``POST /v1/embeddings``: OpenAI's embeddings API over the engine's embedding requests.

Each input is one embedding request in the same scheduler as generation (batched with it,
finished after its prefill); the vector is the model's final hidden states pooled as the
engine's ``--pooling`` says and L2-normalised (vLLM's ``normalize`` extra field turns that
off). Admission, the queue caps, disconnects and errors are the completion endpoint's.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.outputs import EmbeddingRequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.server.completions import prompt_items
from kvserve.server.errors import bad_request
from kvserve.server.protocol import INT64_END, INT64_MIN, Int, PromptInput, _examples, _Request
from kvserve.server.serving import (
    Limits,
    PromptInfo,
    final_outputs,
    is_batch_line,
    make_params,
    new_id,
    run_watching_disconnect,
    start_streams,
    tokenize,
)


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, with vLLM's extra fields."""

    model_config = _examples(
        {"input": "The food was delicious", "encoding_format": "float"},
        {"input": [[1, 504, 3458], "A second text"], "encoding_format": "base64"},
    )

    input: PromptInput  # a string, strings, token ids, or lists of token ids
    model: str | None = None  # None serves the first model, as vLLM does
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32
    dimensions: Int | None = None  # only the model's hidden size is possible
    user: str | None = None  # accepted and ignored
    # vLLM extras: keep the last k tokens of each input (-1: the context length); whether to
    # L2-normalise (vLLM's default: yes); tokenizer special tokens; the priority policy's value
    truncate_prompt_tokens: Int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: Int = Field(0, ge=INT64_MIN, lt=INT64_END)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # the floats, or their float32 bytes in base64
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def _input_items(value: Any, limits: Limits) -> list[str | list[int]]:
    """The four input forms as a list of inputs; empty ones are refused here, by name."""
    items = prompt_items(value, "input")
    for i, item in enumerate(items):
        if len(item) == 0:
            raise bad_request(f"input[{i}] is empty; every input needs at least one token", "input")
    if len(items) > limits.max_prompts_per_request:
        raise bad_request(
            f"the request has {len(items)} inputs, above this server's limit of "
            f"{limits.max_prompts_per_request} (--max-prompts-per-request)",
            "input",
        )
    return items


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as sent: floats, or OpenAI's base64 of its little-endian float32 bytes
    (what the ``openai`` client asks for by default, and decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embedding(
    req: EmbeddingRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    items = _input_items(req.input, limits)
    normalize = req.normalize is not False  # null: vLLM's default, normalised
    params = make_params(
        lambda: PoolingParams(normalize, req.dimensions, req.truncate_prompt_tokens)
    )
    prompts: list[PromptInfo] = []
    for item in items:
        if isinstance(item, str):
            prompts.append(PromptInfo(item, await tokenize(engine, item, req.add_special_tokens)))
        else:
            prompts.append(PromptInfo(None, list(item)))
    request_id = new_id("embd")
    streams = start_streams(engine, prompts, params, request_id, req.priority, is_batch_line(raw))
    outputs = await run_watching_disconnect(raw, final_outputs(streams))
    data: list[EmbeddingData] = []
    num_tokens = 0
    for i, out in enumerate(outputs):
        assert isinstance(out, EmbeddingRequestOutput)  # encode() streams yield only these
        vector = encode_embedding(out.outputs.embedding, req.encoding_format)
        data.append(EmbeddingData(embedding=vector, index=i))
        num_tokens += len(out.prompt_token_ids)  # after truncate_prompt_tokens
    body = EmbeddingResponse(
        id=request_id,
        model=engine.model_name,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return Response(body.model_dump_json(), media_type="application/json")
