"""POST /v1/completions: text or token-id prompts (one, or a list: a choice each, n per prompt) to requests in
flight, and their result as one `text_completion` body or as SSE chunks. The HTTP app (app.py) picks which and wraps
it in the response."""
from __future__ import annotations

from collections.abc import AsyncIterator

from kdtree_jax.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from kdtree_jax.server.serving_common import ChatPlan, Choices, Endpoint, Job, OpenAIServer

COMPLETIONS = Endpoint("prompt", DEFAULT_COMPLETION_MAX_TOKENS, "cmpl-")


class ServingCompletion:
    """The completions endpoint over the shared per-request code of `server`."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    async def start(self, body: CompletionRequest, arrival: float) -> Choices:
        """Check, tokenize and submit; refusals raise ApiError before any response has started."""
        server = self.server
        server.check_model(body.model)
        given = body.prompt if body.prompt is not None else [""]
        prompts = []
        for i, prompt in enumerate(given):
            field = "prompt" if len(given) == 1 else f"prompt[{i}]"
            ids = list(prompt) if isinstance(prompt, list) else await server.encode_text(prompt, field, special=True)
            prompts.append((ids, field))
        spec, field = server.output_constraint(body)
        await server.check_constraint(spec, field)
        return await server.start(prompts, body, COMPLETIONS, arrival, ChatPlan(spec, field))

    def response(self, choices: Choices, texts: list[str], body: CompletionRequest) -> dict:
        out = []
        for job, text in zip(choices.jobs, texts):
            choice = {"index": job.index, "text": text, "logprobs": None, "finish_reason": job.finish_reason,
                      "stop_reason": job.stop_reason}
            if body.return_token_ids:
                choice |= {"prompt_token_ids": job.prompt_ids, "token_ids": job.text.token_ids}
            out.append(choice)
        return {**self.server.head(choices, "text_completion"), "choices": out, "usage": choices.usage(),
                **choices.spec_decode()}

    def events(self, choices: Choices, body: CompletionRequest) -> AsyncIterator[bytes]:
        return self.server.stream(choices, body, self.chunks, "text_completion")

    async def chunks(self, job: Job, body: CompletionRequest) -> AsyncIterator[dict | Job]:
        def chunk(text: str, ids: list[int], finish: str | None = None) -> dict:
            choice = {"index": job.index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            return {**self.server.head(job, "text_completion"), "choices": [choice]}

        async for piece, ids in job.pieces():
            if piece or (ids and body.return_token_ids):
                yield chunk(piece, ids)
        yield self.server.finished(job, chunk("", [], job.finish_reason))
