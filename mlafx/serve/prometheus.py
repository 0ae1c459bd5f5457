"""``GET /metrics``: the engine's state in Prometheus' text exposition format (0.0.4).

``engine_snapshot`` runs on the engine thread (between steps) and reads
``LLM.get_metrics()``, the scheduler's queues and the block manager; ``render`` writes
every series below with its ``# HELP`` and ``# TYPE`` lines. Rates and per-second figures
are cumulative since the engine started (as ``get_metrics`` defines them).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlafx.runtime import LLM

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Series:
    name: str  # without the mlafx_ prefix
    kind: str  # "gauge" or "counter"
    help: str
    key: str  # in the snapshot dict


SERIES = [
    Series("prefix_cache_hit_rate", "gauge",
           "Prompt tokens found in the local prefix cache / prompt tokens looked up.",
           "prefix_cache_hit_rate"),
    Series("external_cache_hit_rate", "gauge",
           "Prompt tokens loaded from the KV connector / prompt tokens looked up.",
           "external_cache_hit_rate"),
    Series("prompt_tokens_per_second", "gauge",
           "Prompt positions computed per second of engine step time.",
           "prompt_tokens_per_s"),
    Series("generation_tokens_per_second", "gauge",
           "Tokens sampled per second of engine step time.", "generation_tokens_per_s"),
    Series("num_requests_waiting", "gauge", "Requests queued, not yet admitted (or preempted).",
           "num_requests_waiting"),
    Series("num_requests_running", "gauge", "Requests admitted and holding KV blocks.",
           "num_requests_running"),
    Series("kv_cache_blocks_in_use", "gauge", "KV blocks held by requests.",
           "kv_cache_blocks_in_use"),
    Series("kv_cache_blocks_total", "gauge", "Usable KV blocks (block 0 is reserved).",
           "kv_cache_blocks_total"),
    Series("kv_cache_blocks_cached", "gauge",
           "KV blocks holding a reusable cached prefix (held or free).",
           "kv_cache_blocks_cached"),
    Series("kv_cache_usage", "gauge", "Fraction of usable KV blocks held by requests.",
           "kv_cache_usage"),
    Series("token_rows_usage", "gauge",
           "DeepSeek-V4: fraction of usable token-row blocks held by requests (0 otherwise).",
           "token_rows_usage"),
    Series("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
           "prompt_tokens"),
    Series("prefix_cache_hit_tokens_total", "counter",
           "Prompt tokens found in the local prefix cache.", "prefix_cache_hit_tokens"),
    Series("external_hit_tokens_total", "counter",
           "Prompt tokens loaded from the KV connector.", "external_hit_tokens"),
    Series("computed_prompt_tokens_total", "counter",
           "Prompt positions computed (recomputation included).", "computed_prompt_tokens"),
    Series("generation_tokens_total", "counter", "Tokens sampled.", "generation_tokens"),
    Series("preemptions_total", "counter", "Running requests preempted for KV blocks.",
           "num_preemptions"),
    Series("requests_total", "counter", "Requests admitted at least once.", "num_requests"),
    Series("requests_finished_total", "counter", "Requests that finished (stop or length).",
           "num_finished_requests"),
    Series("requests_aborted_total", "counter",
           "Requests aborted (client gone, stop string matched, or shutdown).",
           "num_aborted_requests"),
    Series("engine_steps_total", "counter", "Engine steps run.", "num_steps"),
    Series("engine_busy_seconds_total", "counter", "Wall time spent in engine steps.", "busy_s"),
    Series("engine_slow_steps_total", "counter",
           "Steps that took at least twice the recent median of steps their size "
           "(the machine is busy).", "num_slow_steps"),
    Series("engine_last_step_vs_median", "gauge",
           "The latest step's time over the recent median of steps its size (0: too few yet).",
           "last_step_vs_median"),
]  # fmt: skip


def engine_snapshot(llm: LLM) -> dict[str, float]:
    """Every value ``SERIES`` names; call on the engine thread."""
    blocks = llm.block_manager
    scheduler = llm.engine.scheduler
    return {
        **llm.get_metrics(),
        "num_requests_waiting": len(scheduler.waiting),
        "num_requests_running": len(scheduler.running),
        "kv_cache_blocks_in_use": blocks.num_usable_blocks - blocks.num_free_blocks,
        "kv_cache_blocks_total": blocks.num_usable_blocks,
        "kv_cache_blocks_cached": blocks.num_cached_blocks,
    }


def render(snapshot: dict[str, float]) -> str:
    lines = []
    for series in SERIES:
        name = f"mlafx_{series.name}"
        lines += [
            f"# HELP {name} {series.help}",
            f"# TYPE {name} {series.kind}",
            f"{name} {float(snapshot[series.key])!r}",
        ]
    return "\n".join(lines) + "\n"
