"""Samples: the Generate calls of one OpenAI request, one per (prompt, n) pair, run at once.

Every call's first message is awaited before the HTTP response starts, so a request the worker
refuses (unknown adapter, bad sampling, overload) gets its own HTTP status even when streamed. The
first refusal is answered at once: the calls still waiting for their first message (queued behind
others in a busy worker) are cancelled, not awaited.
After that the calls' deltas are merged in arrival order, each tagged with its choice index.
Leaving early (a client gone, an error) cancels every call still running; the worker then frees
the requests within a step.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loramux import AsyncClient, AsyncStream, Completion, Delta, LoramuxError, NotFound

from .errors import ApiError, model_not_found

Event = Delta | Completion  # a choice's new tokens, or its end
SEED_SPACE = 1 << 64


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Sample:
    """One Generate call and the message peeked from it."""

    def __init__(self, stream: AsyncStream):
        self.stream = stream
        self.deltas = aiter(stream)
        self.first: Delta | None = None

    async def peek(self) -> None:
        self.first = await anext(self.deltas, None)

    async def events(self) -> AsyncIterator[Event]:
        if self.first is not None:
            yield self.first
            async for delta in self.deltas:
                yield delta
        yield self.stream.result


class Samples:
    def __init__(self, samples: list[_Sample], n: int, model: str):
        self._samples, self._n, self.model = samples, n, model

    @classmethod
    async def start(
        cls,
        client: AsyncClient,
        model: str,
        adapter: str | None,
        inputs: list[dict],
        n: int,
        sampling: dict,
        seed: int | None,
        request_id: str,
    ) -> "Samples":
        """Starts n calls per input (seeds seed, seed + 1, ...: n different samples that repeat
        with the seed) and waits for each one's first message, or for the first failure."""
        samples = [
            _Sample(
                client.generate(
                    **given, adapter=adapter, request_id=request_id, seed=_seed(seed, j), **sampling
                )
            )
            for given in inputs
            for j in range(n)
        ]
        started = cls(samples, n, model)
        try:
            await asyncio.gather(*(s.peek() for s in samples))
        except BaseException as e:  # the others still peeking run on until closed here
            started.close()
            raise started.api_error(e) from None
        return started

    def api_error(self, error: BaseException) -> BaseException:
        """An SDK error as the HTTP error it is; an unknown adapter is OpenAI's unknown model."""
        if isinstance(error, NotFound):
            return model_not_found(self.model)
        if isinstance(error, LoramuxError):
            return ApiError.from_sdk(error)
        return error

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) as they arrive, every choice's Completion last among its events."""
        try:
            if len(self._samples) == 1:
                async for event in self._samples[0].events():
                    yield 0, event
            else:
                async for tagged in self._merged():
                    yield tagged
        except LoramuxError as e:
            raise self.api_error(e) from e
        finally:
            self.close()

    async def completions(self) -> list[Completion]:
        """Every choice's Completion, in index order."""
        ended: dict[int, Completion] = {}
        async for index, event in self.events():
            if isinstance(event, Completion):
                ended[index] = event
        return [ended[i] for i in range(len(self._samples))]

    def usage(self, completions: list[Completion]) -> Usage:
        """Each prompt counted once (its n samples share it; cached: the tokens all n found cached),
        generated tokens summed over every sample."""
        per_prompt = [completions[i : i + self._n] for i in range(0, len(completions), self._n)]
        return Usage(
            prompt_tokens=sum(group[0].prompt_tokens for group in per_prompt),
            completion_tokens=sum(c.completion_tokens for c in completions),
            cached_tokens=sum(min(c.cached_tokens for c in group) for group in per_prompt),
        )

    def close(self) -> None:
        for sample in self._samples:
            sample.stream.close()

    async def _merged(self) -> AsyncIterator[tuple[int, Event]]:
        queue: asyncio.Queue[tuple[int, Event | LoramuxError]] = asyncio.Queue()

        async def pump(index: int, sample: _Sample) -> None:
            try:
                async for event in sample.events():
                    await queue.put((index, event))
            except LoramuxError as e:
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._samples)]
        try:
            ended = 0
            while ended < len(tasks):
                index, event = await queue.get()
                if isinstance(event, LoramuxError):
                    raise event
                ended += isinstance(event, Completion)
                yield index, event
        finally:
            for task in tasks:
                task.cancel()


def _seed(seed: int | None, j: int) -> int | None:
    return None if seed is None else (seed + j) % SEED_SPACE
