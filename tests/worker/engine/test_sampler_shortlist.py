"""The shortlist sampler against the full-sort one it replaced: the same filtered distribution, the
same seeded tokens. The former implementation is kept below, verbatim but for a `stable` switch, as
the reference."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.engine.sampler import SampleRow, Sampler, draw_key
from worker.engine.shortlist import shortlist
from worker.engine.types import SamplingParams

torch.set_num_threads(1)
QWEN_VOCAB = 151_936
EOS = 5


# --- the former full-sort sampler (worker/engine/sampler.py before shortlists) ----------------------

def filter_logits(logits: torch.Tensor, rows: list[SampleRow], stable: bool = False) -> torch.Tensor:
    """Top-k, then top-p over what is left, then min-p; excluded tokens become -inf."""
    vocab = logits.shape[1]
    ks = [row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows]
    ps = [row.params.top_p for row in rows]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        logits = _top_k_top_p(logits, ks, ps, stable)
    min_ps = [row.params.min_p for row in rows]
    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        scale = torch.tensor(min_ps, device=logits.device).unsqueeze(1)
        floor = scale * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, ks: list[int], ps: list[float], stable: bool) -> torch.Tensor:
    """One descending sort serves both filters; the best token always survives."""
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=stable)
    k = torch.tensor(ks, device=device).unsqueeze(1)
    positions = torch.arange(logits.shape[1], device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(ps, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((mass_before > p) & (positions > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


class FullSortSampler(Sampler):
    """The former `_sample`: the filter above, then the exponential race over the whole vocabulary."""

    def __init__(self, eos_token_ids, stable: bool = False):
        super().__init__(eos_token_ids)
        self.stable = stable

    def _sample(self, logits, rows):
        temps = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        logits = filter_logits(logits / temps.unsqueeze(1), rows, self.stable)
        probs = torch.softmax(logits, dim=-1)
        return (probs / self._exponentials(probs, rows)).argmax(dim=-1)

    def _exponentials(self, probs, rows):
        q = torch.empty_like(probs).exponential_(generator=self._shared_generator(probs.device))
        vocab = probs.shape[1]
        for r, row in enumerate(rows):
            if row.params.seed is not None:
                key = draw_key(row.params.seed, row.choice_index, row.step)
                g = torch.Generator().manual_seed(key)
                q[r] = torch.empty(vocab).exponential_(generator=g).to(probs.device)
        return q.clamp_min_(1e-20)


# --- seeded tokens: the same as the full sort's -------------------------------------------------------

MIXES = [dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(top_p=0.5), dict(top_k=1), dict(top_k=20),
         dict(min_p=0.05), dict(top_k=100, min_p=0.1), dict(top_p=0.95, min_p=0.02), dict(),
         dict(top_k=7, top_p=0.3, temperature=0.5), dict(top_p=0.999, temperature=2.0),
         dict(top_k=40, top_p=0.8, min_p=0.01, temperature=0.7), dict(temperature=0.0)]


def mixed_rows(batch: int, base_seed: int, unseeded_every: int = 5) -> list[SampleRow]:
    """Every parameter mix above, seeded and not, at several steps and choices."""
    rows = []
    for r in range(batch):
        params = {"temperature": 1.0, **MIXES[r % len(MIXES)]}
        seed = None if r % unseeded_every == unseeded_every - 1 else base_seed + r
        rows.append(SampleRow(SamplingParams(seed=seed, **params), [1, 2], [3] * (r % 4), r % 2))
    return rows


def assert_seeded_tokens_equal(new, old, rows):
    checked = [r for r, row in enumerate(rows) if row.params.seed is not None or row.params.greedy]
    assert [new[r] for r in checked] == [old[r] for r in checked]
    assert len(checked) > len(rows) // 2


@pytest.mark.parametrize("scale", [3.0, 0.5])
def test_seeded_tokens_match_the_full_sort_on_a_qwen_sized_vocabulary(scale):
    """Scale 3 puts ~6,500 tokens in a 0.9 nucleus (the shortlist grows twice), scale 0.5 makes
    top_p 0.999 run the full path."""
    logits = torch.randn(39, QWEN_VOCAB, generator=torch.Generator().manual_seed(11)) * scale
    rows = mixed_rows(39, base_seed=100)
    new, _ = Sampler([EOS])(logits, rows)
    old, _ = FullSortSampler([EOS])(logits, rows)
    assert_seeded_tokens_equal(new, old, rows)


@pytest.mark.parametrize("vocab", [2, 7, 32, 1000])
def test_seeded_tokens_match_the_full_sort_on_small_vocabularies(vocab):
    sampler, reference = Sampler([EOS]), FullSortSampler([EOS])
    for trial in range(6):
        logits = torch.randn(130, vocab, generator=torch.Generator().manual_seed(trial)) * (1 + trial)
        rows = mixed_rows(130, base_seed=1000 * trial)
        assert_seeded_tokens_equal(sampler(logits, rows)[0], reference(logits, rows)[0], rows)


def test_seeded_tokens_with_tied_logits_match_the_stable_full_sort():
    """bf16 logits tie often at a top-k or top-p cut: the lowest ids among the tied survive, as in the
    full sort made stable (the former unstable sort kept an arbitrary subset of them)."""
    logits = (torch.randn(26, QWEN_VOCAB, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    rows = mixed_rows(26, base_seed=7)
    new, _ = Sampler([EOS])(logits, rows)
    old, _ = FullSortSampler([EOS], stable=True)(logits, rows)
    assert_seeded_tokens_equal(new, old, rows)


def test_seeded_rows_keep_their_tokens_whatever_their_batch_mates_filter():
    """A row's shortlist is as wide as its batch needs; its token must not depend on that."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3)) * 2
    target = SampleRow(SamplingParams(seed=42, top_k=30, top_p=0.8), [1], [2, 3])
    alone = Sampler([EOS])(logits[:1], [target])[0][0]
    mates = [SampleRow(SamplingParams(top_p=0.99), [1], []), SampleRow(SamplingParams(seed=1), [1], [])]
    assert Sampler([EOS])(logits, [target] + mates)[0][0] == alone


# --- the filtered distribution: the same as the full sort's ------------------------------------------

def shortlist_probs(logits, params, first_width) -> torch.Tensor:
    vals, ids = shortlist(logits, [p.top_k for p in params], [p.top_p for p in params],
                          [p.min_p for p in params], first_width)
    return torch.zeros_like(logits).scatter_add_(1, ids, torch.softmax(vals, dim=-1))


def reference_probs(logits, params, nudge: float = 0.0) -> torch.Tensor:
    rows = [SampleRow(SamplingParams(top_k=p.top_k, top_p=min(1.0, max(p.top_p + nudge, 1e-9)),
                                     min_p=p.min_p), [], []) for p in params]
    return torch.softmax(filter_logits(logits, rows, stable=True), dim=-1)


@st.composite
def filtered_batches(draw):
    """Logits with ties and -inf entries (one finite per row at least), divided by a temperature, and
    per-row top-k / top-p / min-p, each on or off."""
    vocab = draw(st.integers(1, 40))
    batch = draw(st.integers(1, 4))
    value = st.one_of(st.integers(-4, 4).map(lambda v: v / 2),
                      st.floats(-8, 8, allow_nan=False, width=32), st.just(float("-inf")))
    logits = torch.tensor(draw(st.lists(st.lists(value, min_size=vocab, max_size=vocab),
                                        min_size=batch, max_size=batch)), dtype=torch.float32)
    logits[:, draw(st.integers(0, vocab - 1))] = draw(st.floats(-8, 8, width=32))
    temperature = draw(st.floats(0.05, 5.0))
    params = [SamplingParams(
        top_k=draw(st.one_of(st.sampled_from([0, -1]), st.integers(1, vocab + 2))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    ) for _ in range(batch)]
    first_width = draw(st.sampled_from([1, 2, 3, 5, 256]))
    return logits / temperature, params, first_width


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filtered_batches())
def test_filtered_distribution_equals_the_full_sort(batch):
    """Row by row, allclose to the stable full sort's. Where a token's preceding mass lies within
    float rounding of top_p, the two may cut on either side of it (the full sort summed the mass in
    another order): such a row must then match the reference with top_p nudged by 1e-5."""
    logits, params, first_width = batch
    got = shortlist_probs(logits, params, first_width)
    refs = [reference_probs(logits, params, nudge) for nudge in (0.0, -1e-5, 1e-5)]
    for r in range(len(params)):
        assert any(torch.allclose(got[r], ref[r], atol=1e-6) for ref in refs), (r, params[r])


def test_filtered_distribution_on_a_qwen_sized_vocabulary():
    """The growing shortlist (256, 2,048, 16,384, then the whole vocabulary) on real sizes, against
    the full sort in float64: in float32 its 151,936 probabilities sum to about 1 + 3e-5, which moves
    a 0.9 cut by a few tokens; the shortlist measures the row's mass in float64."""
    logits = torch.randn(6, QWEN_VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    logits[5] *= 0.1  # nearly flat: top_p 0.99 needs the full path
    params = [SamplingParams(**kw) for kw in (
        dict(top_p=0.9), dict(top_k=50, top_p=0.9), dict(top_p=0.3), dict(top_p=0.9, min_p=0.2),
        dict(top_k=5000), dict(top_p=0.99))]
    got = shortlist_probs(logits, params, 256)
    assert torch.allclose(got, reference_probs(logits.double(), params).float(), atol=1e-7)
    assert (got[0] > 0).sum() > 2048  # the case that needs the shortlist to grow


# --- unseeded rows: the right distribution -----------------------------------------------------------

@pytest.mark.parametrize("params, expected", [
    (dict(), [0.4, 0.3, 0.2, 0.1]),
    (dict(top_k=2), [4 / 7, 3 / 7, 0.0, 0.0]),
    (dict(top_p=0.8), [4 / 9, 3 / 9, 2 / 9, 0.0]),
    (dict(min_p=0.4), [4 / 9, 3 / 9, 2 / 9, 0.0]),
])
def test_unseeded_draws_follow_the_filtered_distribution(params, expected):
    n = 20_000
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(n, 4)
    rows = [SampleRow(SamplingParams(**params), [0], []) for _ in range(n)]
    counts = torch.bincount(torch.tensor(Sampler([EOS])(logits, rows)[0]), minlength=4)
    for count, p in zip(counts.tolist(), expected):
        assert abs(count / n - p) <= 6 * math.sqrt(p * (1 - p) / n) + 1e-9  # 6 sigma: no flakes


@pytest.mark.parametrize("params", [dict(), dict(top_p=0.9), dict(top_k=3)])
def test_a_row_of_nan_logits_fails_alone(params):
    """No valid token can come from NaN logits: that row gets an error, its batch-mates their tokens."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1] = math.nan
    rows = [SampleRow(SamplingParams(**params), [0], []) for _ in range(3)]
    tokens, _ = Sampler([EOS]).sample(logits, rows)
    assert isinstance(tokens[1], Exception)
    assert all(isinstance(t, int) and 0 <= t < 50 for t in (tokens[0], tokens[2]))


@pytest.mark.parametrize("width", [300, 2048])
def test_unseeded_draws_of_a_large_batch_follow_the_distribution(width):
    """A batch large enough for the two-level draw (blocks of columns, then a column): every
    column's share within 6 sigma, columns without mass never drawn, tiny masses kept."""
    n = 40_000
    probs = torch.zeros(width)
    probs[[0, 127, 128, width - 1]] = torch.tensor([0.3, 0.2, 0.1, 0.4 - 1e-3])
    probs[200:220] = 1e-3 / 20  # small masses spread over a block
    logits = torch.log(probs).expand(n, width)  # log 0 = -inf: no mass
    rows = [SampleRow(SamplingParams(), [0], []) for _ in range(n)]
    counts = torch.bincount(torch.tensor(Sampler([EOS])(logits, rows)[0]), minlength=width).double()
    assert counts[probs == 0].sum() == 0
    for column in [0, 127, 128, width - 1]:
        p = probs[column].item()
        assert abs(counts[column].item() / n - p) <= 6 * math.sqrt(p * (1 - p) / n)
    small = counts[200:220].sum().item() / n
    assert abs(small - 1e-3) <= 6 * math.sqrt(1e-3 / n)
