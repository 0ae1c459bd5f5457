"""What the benchmark measures: the default plan (< 10 minutes on 2 cores) and ``--quick``.

mlafx's compiled step gets the whole grid. The baselines cost 10-30x more per step, so they
get the target point plus a few points along each axis; ``torch.compile`` compiles anew for
batch 1 (dynamo specialises sizes 0 and 1), for prefill vs decode and for some new sizes,
30-60 s each here, so by default it runs the target point only. Sized so that the default
plan ends in under 10 minutes on 2 shared, busy cores (~4-5 on a quiet machine).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.e2e.serving import MixedWorkload

Point = tuple[int, int]  # (batch, prompt length or context)
BACKENDS = ("mlafx", "mlafx_invariant", "mlafx_reference", "hf_eager", "hf_compile")


@dataclass(frozen=True)
class Grid:
    prefill: tuple[Point, ...]
    decode: tuple[Point, ...]

    def points(self, phase: str) -> tuple[Point, ...]:
        return self.prefill if phase == "prefill" else self.decode


@dataclass(frozen=True)
class Plan:
    model: str
    target: Point  # the targets: batch 8, prompts of 1024 tokens
    grids: dict[str, Grid]  # backend -> its points
    repeats: int  # timed calls per point after one warm-up call (mlafx compiled)
    baseline_repeats: int  # the same for the baselines
    workload: MixedWorkload
    prefix_prompt_len: int
    prefix_repeats: int

    def repeats_for(self, backend: str) -> int:
        return self.repeats if backend in ("mlafx", "mlafx_invariant") else self.baseline_repeats


def _grid(batches: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[Point, ...]:
    return tuple((b, n) for b in batches for n in lengths)


DEFAULT = Plan(
    model="embedded",
    target=(8, 1024),
    grids={
        "mlafx": Grid(
            prefill=(*_grid((1,), (128, 256, 512, 1024, 2048, 4096)), (8, 1024)),
            decode=_grid((1, 8, 32), (512, 1024, 2048, 4096, 8192)),
        ),
        # the same compiled step in batch-invariant mode: its cost at the target and around
        "mlafx_invariant": Grid(
            prefill=((1, 1024), (8, 1024)), decode=((1, 1024), (8, 1024), (32, 1024))
        ),
        # the reference model attends over the step's flat key rows (masked), quadratic in
        # the step's total tokens: 8 x 1024 alone costs it ~45 s a call here
        "mlafx_reference": Grid(
            prefill=((1, 128), (1, 1024)), decode=((1, 1024), (8, 512), (8, 1024))
        ),
        "hf_eager": Grid(
            prefill=((1, 128), (1, 1024), (8, 1024)),
            decode=((1, 1024), (8, 512), (8, 1024), (32, 1024)),
        ),
        "hf_compile": Grid(prefill=((8, 1024),), decode=((8, 1024),)),
    },
    repeats=3,
    baseline_repeats=3,
    workload=MixedWorkload(num_requests=8, prompt_lens=(64, 128, 256, 512), max_tokens=16),
    prefix_prompt_len=300,
    prefix_repeats=5,  # the cold and hit TTFTs are single engine steps: noisy
)

_QUICK_BASELINE = Grid(prefill=((1, 32), (8, 128)), decode=((1, 128), (8, 128)))
QUICK = Plan(
    model="tiny",
    target=(8, 128),
    grids={
        "mlafx": Grid(prefill=((1, 32), (1, 128), (8, 128)), decode=_grid((1, 8), (64, 128))),
        "mlafx_invariant": Grid(prefill=((8, 128),), decode=((8, 128),)),
        "mlafx_reference": _QUICK_BASELINE,
        "hf_eager": _QUICK_BASELINE,
        "hf_compile": Grid(prefill=((8, 128),), decode=((8, 128),)),
    },
    repeats=3,
    baseline_repeats=2,
    workload=MixedWorkload(num_requests=4, prompt_lens=(16, 48), max_tokens=4),
    prefix_prompt_len=300,
    prefix_repeats=2,
)


# --quantization: mlafx's compiled engine alone (its reference and transformers' run the bf16
# model, which the full preset cannot fit), on all of DeepSeek-V2-Lite.
QUANTIZED = Plan(
    model="full",
    target=(8, 1024),
    grids={"mlafx": Grid(prefill=((1, 1024),), decode=((1, 1024), (8, 1024)))},
    repeats=2,  # a prefill of 1024 tokens over 27 layers takes minutes on the portable kernels
    baseline_repeats=0,
    workload=MixedWorkload(num_requests=4, prompt_lens=(64, 256), max_tokens=8),
    prefix_prompt_len=300,
    prefix_repeats=2,
)
