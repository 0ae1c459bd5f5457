"""Model-free engine loops for the scheduler tests (``test_scheduler.py``, ``test_token_rows.py``):
requests, what the engine does after a step, and random traffic sharing prefixes."""

from __future__ import annotations

import random
from collections.abc import Callable

from mlafx.runtime.request import Request
from mlafx.runtime.sampling_params import RequestMetrics, SamplingParams
from mlafx.runtime.scheduler import ScheduledSequence, Scheduler


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), RequestMetrics(0.0))


def finish_step(scheduler: Scheduler, batch: list[ScheduledSequence]) -> None:
    """What the engine does after the model ran: rows computed, a token for finished
    prompts, full blocks offered to the prefix cache."""
    for seq in batch:
        r = seq.request
        r.num_computed_tokens = seq.end
        scheduler.register_computed_blocks(r)
        assert len(r.blocks) * scheduler.block_size >= seq.end
        if seq.end == r.num_tokens:
            r.output_token_ids.append(7)
            if len(r.output_token_ids) == r.params.max_tokens:
                scheduler.finish(r)


def random_traffic(
    scheduler: Scheduler,
    rng: random.Random,
    check: Callable[[list[ScheduledSequence]], None],
    *,
    stem_len: int = 30,
    extra: int = 12,
    arrive: float = 0.3,
    abort: float = 0.03,
    steps: int = 3000,
) -> None:
    """Requests arrive for 300 steps (a prefix of one of three stems of ``stem_len`` tokens,
    then up to ``extra`` random ones; 1-30 new tokens), random ones are aborted, and every
    step's batch goes through ``check`` before the engine's bookkeeping (a token that depends
    on the whole sequence); ends when all have finished, which it asserts."""
    stems = [[rng.randrange(50) for _ in range(stem_len)] for _ in range(3)]
    live: list[Request] = []
    for step in range(steps):
        if step < 300 and rng.random() < arrive:
            prompt = rng.choice(stems)[: rng.randint(1, stem_len)] + [
                rng.randrange(50) for _ in range(rng.randint(0, extra))
            ]
            live.append(request(str(step), prompt or [1], max_tokens=rng.randint(1, 30)))
            scheduler.add(live[-1])
        if live and rng.random() < abort:
            scheduler.abort(live.pop(rng.randrange(len(live))))
        batch = scheduler.schedule()
        check(batch)
        for seq in batch:
            r = seq.request
            r.num_computed_tokens = seq.end
            scheduler.register_computed_blocks(r)
            if seq.samples:
                r.output_token_ids.append(sum(r.token_ids(0, r.num_tokens)) % 50)
                if len(r.output_token_ids) == r.params.max_tokens:
                    scheduler.finish(r)
                    live.remove(r)
        if step >= 300 and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished() and not live
