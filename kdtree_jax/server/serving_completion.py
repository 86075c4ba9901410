"""POST /v1/completions: text or token-id prompts (one, or a list: a choice each, n per prompt) to requests in
flight, and their result as one `text_completion` body or as SSE chunks. The HTTP app (app.py) picks which and wraps
it in the response.

`logprobs: k` gives each completion token's log-probability and its k alternatives (the legacy `logprobs` object);
`echo` puts the prompt's text before the completion (each choice its own prompt's), and with `logprobs` its tokens'
log-probabilities too (the first token's None), computed by a prefill of the whole prompt; `max_tokens: 0` with
`echo` answers the prompt alone, as a loglikelihood evaluation (lm-eval) asks."""
from __future__ import annotations

from collections.abc import AsyncIterator

from kdtree_jax.server.logprobs import completion_logprobs
from kdtree_jax.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, ApiError, CompletionRequest
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
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 needs echo (the response is then the prompt alone)", param="max_tokens")
        given = body.prompt if body.prompt is not None else [""]
        prompts = []
        for i, prompt in enumerate(given):
            field = "prompt" if len(given) == 1 else f"prompt[{i}]"
            ids = list(prompt) if isinstance(prompt, list) else await server.encode_text(prompt, field, special=True)
            prompts.append((ids, field))
        spec, field = server.output_constraint(body)
        await server.check_constraint(spec, field)
        k = body.logprobs
        return await server.start(prompts, body, COMPLETIONS, arrival, ChatPlan(spec, field),
                                  logprobs=(k, k if body.echo else None, "logprobs"))

    def _echo(self, job: Job, body: CompletionRequest) -> str:
        return self.server.tokenizer.decode(job.prompt_ids) if body.echo else ""

    @staticmethod
    def _finish(job: Job) -> str:
        return "length" if job.hide_output and not job.failed else job.finish_reason

    def _logprobs(self, job: Job, body: CompletionRequest) -> dict | None:
        """Every token of the choice's text (its prompt's where echoed, then its completion's) with its entry."""
        if body.logprobs is None:
            return None
        tokens, entries = [], []
        if body.echo:
            tokens += job.prompt_ids
            entries += job.prompt_logprobs or [None] * len(job.prompt_ids)
        if not job.hide_output:
            tokens += job.text.token_ids
            entries += job.logprobs
        return completion_logprobs(self.server.token_texts, tokens, entries, body.logprobs)

    def response(self, choices: Choices, texts: list[str], body: CompletionRequest) -> dict:
        out = []
        for job, text in zip(choices.jobs, texts):
            text = self._echo(job, body) + ("" if job.hide_output else text)
            choice = {"index": job.index, "text": text, "logprobs": self._logprobs(job, body),
                      "finish_reason": self._finish(job), "stop_reason": job.stop_reason}
            if body.return_token_ids:
                choice |= {"prompt_token_ids": job.prompt_ids,
                           "token_ids": [] if job.hide_output else job.text.token_ids}
            out.append(choice)
        return {**self.server.head(choices, "text_completion"), "choices": out, "usage": choices.usage(),
                **choices.spec_decode()}

    def events(self, choices: Choices, body: CompletionRequest) -> AsyncIterator[bytes]:
        return self.server.stream(choices, body, self.chunks, "text_completion")

    async def chunks(self, job: Job, body: CompletionRequest) -> AsyncIterator[dict | Job]:
        """One choice's chunks: its prompt where echoed, its text as it comes, its finish chunk."""
        texts, k = self.server.token_texts, body.logprobs
        offset, sent = 0, 0  # text offset of the next token; completion entries sent so far

        def chunk(text: str, ids: list[int], finish: str | None = None, logprobs: dict | None = None) -> dict:
            choice = {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            return {**self.server.head(job, "text_completion"), "choices": [choice]}

        def logprobs(tokens: list[int], entries: list) -> dict | None:
            nonlocal offset
            if k is None:
                return None
            out = completion_logprobs(texts, tokens, entries, k, offset)
            offset += sum(len(texts(t)[0]) for t in tokens)
            return out

        echoed = not body.echo
        async for piece, ids in job.pieces():
            if not echoed:  # the prompt's entries came with the first tokens
                echoed = True
                prompt = job.prompt_ids
                yield chunk(self._echo(job, body), [], logprobs=logprobs(
                    prompt, job.prompt_logprobs or [None] * len(prompt)))
            if job.hide_output:
                continue
            entries, sent = job.logprobs[sent: sent + len(ids)], sent + len(ids)
            if piece or (ids and (body.return_token_ids or k is not None)):
                yield chunk(piece, ids, logprobs=logprobs(ids, entries) if ids else None)
        yield self.server.finished(job, chunk("", [], self._finish(job)))
