"""Running the `n` generations of one request as one stream of (choice index, response).

The choices share their prompt: choice 0 runs first, and the others start once its first
response arrived, when the prompt's KV is computed and in the engine's prefix cache, so they
compute only the prompt's last, partly filled block (on the same replica; a server with several
`llm` instances may place a choice on another, which computes the prompt once more). One failing
generation fails them all, and closing the stream (the client went away) cancels every one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from splitfuse.openai_api.triton_llm import GenerationError, Step

# A choice's generation: its responses until the final one (TritonLLM.generate).
StartChoice = Callable[[int], AsyncIterator[Step]]


async def run_choices(start: StartChoice, n: int) -> AsyncIterator[tuple[int, Step]]:
    """Every choice's responses as they arrive, until each sent its final one. Use it under
    `contextlib.aclosing`: closing it cancels the generations still running."""
    queue: asyncio.Queue[tuple[int, Step | None, GenerationError | None]] = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(start(i)) as steps:
                async for step in steps:
                    if i == 0 and len(tasks) == 1:  # choice 0's first response: the prompt is cached
                        tasks.extend(asyncio.ensure_future(pump(j)) for j in range(1, n))
                    await queue.put((i, step, None))
        except GenerationError as e:
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks.append(asyncio.ensure_future(pump(0)))
    try:
        running = n
        while running:
            i, step, error = await queue.get()
            if error is not None:
                raise error
            if step is None:
                running -= 1
            else:
                yield i, step
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
