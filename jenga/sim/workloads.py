"""Seeded synthetic workloads: the papers' traces and the engines' standard generators.

Rationale
    The simulator must run with no downloads, so traces are synthesized from the
    statistics the papers publish (length ranges, means, shared-prefix structure) rather
    than read from the datasets. Token ids matter only for prefix caching: two requests
    share a cached prefix exactly when their leading ids are equal, so every generator
    builds prompts from explicit shared segments plus per-request random ids.

Approach
    Each generator is a function ``(params, rng) -> list[Request]`` registered in
    `GENERATORS` under a CLI name. Lengths come from `random.Random(seed)`; token ids
    of unique text are drawn from a large id space so accidental sharing has negligible
    probability. Image tokens are a run of ids derived from an image key (the same image
    gives the same ids, hence the same block hashes). Arrival times are then stamped by
    `stamp_arrivals` (all at once or Poisson at a rate).

Limitations
    Length distributions are simple parametric stand-ins (uniform, log-normal) matched to
    the published ranges and means, not the datasets' empirical histograms. Output
    lengths are fixed at generation time (no EOS sampling).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

VOCAB_BITS = 30  # id space for unique text (2^30 ids): random prompts never collide
IMAGE_ID_BASE = 1 << 31  # image token ids live above every text id


class WorkloadError(ValueError):
    """A workload parameter is out of range (non-positive length, rate, count...)."""


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    ``prompt`` holds every prompt token id in sequence order; the first ``image_tokens``
    of them are the image's tokens (cross-attention / vision-embedding input), the rest
    is text. ``output`` is the token ids the engine will generate, fixed in advance so a
    later turn of a conversation can quote them. A request with ``after`` set (the next
    turn of a closed-loop client) arrives ``think_s`` after that request finished.
    """

    req_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    arrival_s: float = 0.0
    image_tokens: int = 0
    after: str = ""  # closed loop: sent ``think_s`` after request ``after`` finished
    think_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise WorkloadError(f"request {self.req_id}: empty prompt")
        if not self.output:
            raise WorkloadError(f"request {self.req_id}: output_len must be >= 1")
        if not 0 <= self.image_tokens < len(self.prompt):
            raise WorkloadError(
                f"request {self.req_id}: image_tokens {self.image_tokens} must leave at "
                f"least one text token of a {len(self.prompt)}-token prompt"
            )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def output_len(self) -> int:
        return len(self.output)

    @property
    def text_tokens(self) -> int:
        return len(self.prompt) - self.image_tokens


@dataclass(frozen=True)
class Trace:
    """A named list of requests sorted by arrival time."""

    name: str
    requests: tuple[Request, ...]
    params: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    """``n`` ids from the text id space (unique to this call with high probability)."""
    draw = rng.getrandbits
    return tuple([draw(VOCAB_BITS) for _ in range(n)])


def image_ids(image_key: int, n: int) -> tuple[int, ...]:
    """The token ids of image ``image_key``: equal images give equal ids."""
    base = IMAGE_ID_BASE + (image_key % (1 << 20)) * (1 << 14)
    return tuple(base + i for i in range(n))


def _positive(name: str, value: float) -> None:
    if not value > 0:  # NaN compares false: refused too
        raise WorkloadError(f"{name} must be > 0, got {value}")
    if value == math.inf:
        raise WorkloadError(f"{name} must be finite, got {value}")


def _make(
    req_id: str, prompt: tuple[int, ...], out_len: int, rng: random.Random, image_tokens: int = 0
) -> Request:
    output = random_ids(rng, out_len)
    return Request(req_id=req_id, prompt=prompt, output=output, image_tokens=image_tokens)


# --- the papers' traces ------------------------------------------------------------------


def mmlu_pro(
    rng: random.Random, num_requests: int = 200, max_input: int = 3076, output_len: int = 64
) -> list[Request]:
    """MMLU-pro-like: question prompts up to 3,076 tokens (log-normal, median ~600)."""
    _positive("num_requests", num_requests)
    reqs = []
    for i in range(num_requests):
        n = min(max_input, max(32, int(rng.lognormvariate(math.log(600), 0.6))))
        reqs.append(_make(f"mmlu-{i}", random_ids(rng, n), output_len, rng))
    return reqs


def arxiv_qa(
    rng: random.Random,
    num_requests: int = 20,
    min_input: int = 55_000,
    max_input: int = 110_000,
    min_output: int = 50,
    max_output: int = 100,
) -> list[Request]:
    """arXiv-QA (Jenga paper §7.3): 20 long documents, inputs 55-110K, outputs 50-100."""
    _positive("num_requests", num_requests)
    if not 0 < min_input <= max_input or not 0 < min_output <= max_output:
        raise WorkloadError(
            f"bad ranges: input {min_input}-{max_input}, output {min_output}-{max_output}"
        )
    return [
        _make(
            f"arxiv-{i}",
            random_ids(rng, rng.randint(min_input, max_input)),
            rng.randint(min_output, max_output),
            rng,
        )
        for i in range(num_requests)
    ]


def mmmu_pro(
    rng: random.Random,
    num_requests: int = 100,
    image_tokens: int = 6193,
    text_tokens: int = 43,
    output_len: int = 32,
    num_images: int = 0,
) -> list[Request]:
    """MMMU-pro-like: one image (6,193 tokens) + 43 text tokens per request.

    ``num_images`` > 0 draws images from that many distinct ones (repeats hit the cache);
    0 gives every request its own image.
    """
    _positive("num_requests", num_requests)
    _positive("image_tokens", image_tokens)
    _positive("text_tokens", text_tokens)
    reqs = []
    for i in range(num_requests):
        key = rng.randrange(num_images) if num_images > 0 else rng.randrange(1 << 20)
        prompt = image_ids(key, image_tokens) + random_ids(rng, text_tokens)
        reqs.append(_make(f"mmmu-{i}", prompt, output_len, rng, image_tokens=image_tokens))
    return reqs


def sharegpt(
    rng: random.Random,
    num_requests: int = 200,
    mean_input: int = 1085,
    mean_output: int = 256,
    max_input: int = 16_000,
    max_output: int = 2_048,
) -> list[Request]:
    """ShareGPT-like chat: log-normal input (mean ~1,085) and output lengths, capped."""
    _positive("num_requests", num_requests)
    _positive("max_input", max_input)
    _positive("max_output", max_output)
    sigma = 0.9
    mu_in = math.log(mean_input) - sigma * sigma / 2
    mu_out = math.log(mean_output) - sigma * sigma / 2
    reqs = []
    for i in range(num_requests):
        n_in = max(4, min(max_input, int(rng.lognormvariate(mu_in, sigma))))
        n_out = max(1, min(max_output, int(rng.lognormvariate(mu_out, sigma))))
        reqs.append(_make(f"sharegpt-{i}", random_ids(rng, n_in), n_out, rng))
    return reqs


def articles_questions(
    rng: random.Random,
    num_articles: int = 8,
    questions_per_article: int = 8,
    article_len: int = 4096,
    question_len: int = 64,
    output_len: int = 32,
    shuffle: int = 1,
    min_article_len: int = 0,
    max_article_len: int = 0,
) -> list[Request]:
    """N articles x M questions (Jenga paper Fig. 17): each prompt = article + question.

    Articles are ``article_len`` tokens, or uniform in ``[min_article_len,
    max_article_len]`` when ``max_article_len`` > 0 (arXiv articles vary in length).
    ``shuffle=1`` (default) sends the N x M questions in a seeded random order;
    ``shuffle=0`` round-robin over articles (q0 of every article, then q1, ...), which an
    LRU cache smaller than all articles never hits.
    """
    for name, v in (
        ("num_articles", num_articles),
        ("questions_per_article", questions_per_article),
        ("article_len", article_len),
        ("question_len", question_len),
    ):
        _positive(name, v)
    if max_article_len and not 0 < min_article_len <= max_article_len:
        raise WorkloadError(
            f"bad article length range {min_article_len}-{max_article_len} (need 0 < min <= max)"
        )

    def length() -> int:
        return rng.randint(min_article_len, max_article_len) if max_article_len else article_len

    articles = [random_ids(rng, length()) for _ in range(num_articles)]
    reqs = [
        _make(f"art{a}-q{q}", articles[a] + random_ids(rng, question_len), output_len, rng)
        for q in range(questions_per_article)
        for a in range(num_articles)
    ]
    if shuffle:
        rng.shuffle(reqs)
    return reqs


def arxiv_qa_stream(
    rng: random.Random,
    num_requests: int = 60,
    min_mean: int = 8_000,
    max_mean: int = 110_000,
    spread: float = 0.25,
    min_output: int = 50,
    max_output: int = 100,
    dynamic: int = 1,
) -> list[Request]:
    """Long-document QA whose average length moves over time (Jenga paper Fig. 16c/d).

    Request i's length is uniform in ``mean_i x [1 - spread, 1 + spread]``, capped at
    ``max_mean``. ``dynamic=1``: ``mean_i`` rises linearly from ``min_mean`` to
    ``max_mean`` over the first half of the trace and falls back over the second, so
    the average length sweeps its range uniformly in time; ``dynamic=0`` (the static
    trace): every ``mean_i`` is the midpoint. Give arrivals a rate (``--rate``) so the
    mix drifts while requests run.
    """
    _positive("num_requests", num_requests)
    if not 0 < min_mean <= max_mean or not 0.0 <= spread < 1.0:
        raise WorkloadError(f"bad means {min_mean}-{max_mean} or spread {spread}")
    if not 0 < min_output <= max_output:
        raise WorkloadError(f"bad output range {min_output}-{max_output}")
    reqs = []
    for i in range(num_requests):
        phase = 1.0 - abs(2.0 * i / max(1, num_requests - 1) - 1.0) if dynamic else 0.5
        mean = min_mean + phase * (max_mean - min_mean)
        lo, hi = int(mean * (1 - spread)), min(max_mean, int(mean * (1 + spread)))
        n = rng.randint(max(1, min(lo, hi)), hi)
        reqs.append(_make(f"doc-{i}", random_ids(rng, n), rng.randint(min_output, max_output), rng))
    return reqs


def multi_turn_chat(
    rng: random.Random,
    num_clients: int = 16,
    num_rounds: int = 4,
    shared_prefix_len: int = 500,
    request_len: int = 128,
    output_len: int = 128,
    closed_loop: int = 0,
    think_s: float = 1.0,
) -> list[Request]:
    """Multi-turn chat (SGLang's generator; Jenga's with a 500-token shared system prompt).

    Turn k of a client quotes its whole history: shared prefix + (request, answer) of
    every previous turn + the new request. Turns of all clients are interleaved by round.
    ``closed_loop=1``: a client sends turn k ``think_s`` seconds after turn k-1 finished
    (a person reading the answer); 0: every turn is an independent arrival.
    """
    for name, v in (
        ("num_clients", num_clients),
        ("num_rounds", num_rounds),
        ("request_len", request_len),
        ("output_len", output_len),
    ):
        _positive(name, v)
    system = random_ids(rng, shared_prefix_len) if shared_prefix_len > 0 else ()
    history = [system for _ in range(num_clients)]
    reqs = []
    for rnd in range(num_rounds):
        for c in range(num_clients):
            prompt = history[c] + random_ids(rng, request_len)
            req = _make(f"client{c}-turn{rnd}", prompt, output_len, rng)
            if closed_loop and rnd:
                req = replace(req, after=f"client{c}-turn{rnd - 1}", think_s=think_s)
            history[c] = prompt + req.output
            reqs.append(req)
    return reqs


# --- the engines' standard generators ----------------------------------------------------


def vllm_random(
    rng: random.Random,
    num_requests: int = 200,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[Request]:
    """vLLM ``--dataset-name random``: lengths uniform in [n(1-r), n(1+r)], a shared prefix."""
    _positive("num_requests", num_requests)
    if not 0.0 <= range_ratio < 1.0:
        raise WorkloadError(f"range_ratio must be in [0, 1), got {range_ratio}")
    prefix = random_ids(rng, prefix_len) if prefix_len > 0 else ()

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [
        _make(f"random-{i}", prefix + random_ids(rng, draw(input_len)), draw(output_len), rng)
        for i in range(num_requests)
    ]


def vllm_prefix_repetition(
    rng: random.Random,
    num_requests: int = 200,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
) -> list[Request]:
    """vLLM ``--dataset-name prefix_repetition``: requests spread over `num_prefixes` prefixes."""
    for name, v in (
        ("num_requests", num_requests),
        ("prefix_len", prefix_len),
        ("suffix_len", suffix_len),
        ("num_prefixes", num_prefixes),
    ):
        _positive(name, v)
    prefixes = [random_ids(rng, prefix_len) for _ in range(num_prefixes)]
    reqs = [
        _make(
            f"prefrep-{i}",
            prefixes[i % num_prefixes] + random_ids(rng, suffix_len),
            output_len,
            rng,
        )
        for i in range(num_requests)
    ]
    rng.shuffle(reqs)
    return reqs


def sglang_generated_shared_prefix(
    rng: random.Random,
    num_groups: int = 8,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 128,
) -> list[Request]:
    """SGLang ``generated-shared-prefix``: groups share a system prompt, each adds a question."""
    for name, v in (
        ("num_groups", num_groups),
        ("prompts_per_group", prompts_per_group),
        ("system_prompt_len", system_prompt_len),
        ("question_len", question_len),
    ):
        _positive(name, v)
    systems = [random_ids(rng, system_prompt_len) for _ in range(num_groups)]
    reqs = [
        _make(f"gsp{g}-{p}", systems[g] + random_ids(rng, question_len), output_len, rng)
        for g in range(num_groups)
        for p in range(prompts_per_group)
    ]
    rng.shuffle(reqs)
    return reqs


Generator = Callable[..., list[Request]]

GENERATORS: dict[str, Generator] = {
    "mmlu-pro": mmlu_pro,
    "arxiv-qa": arxiv_qa,
    "arxiv-qa-stream": arxiv_qa_stream,
    "mmmu-pro": mmmu_pro,
    "sharegpt": sharegpt,
    "articles-questions": articles_questions,
    "multi-turn": multi_turn_chat,
    "random": vllm_random,
    "prefix-repetition": vllm_prefix_repetition,
    "generated-shared-prefix": sglang_generated_shared_prefix,
}


def stamp_arrivals(
    requests: list[Request], rng: random.Random, rate: float | None
) -> list[Request]:
    """All at time 0 (``rate=None``) or Poisson arrivals at ``rate`` requests per second.

    Closed-loop follow-ups (``after`` set) get time 0: the engine releases them."""
    if rate is None:
        return [replace(r, arrival_s=0.0) for r in requests]
    _positive("rate", rate)
    t = 0.0
    out = []
    for r in requests:
        if r.after:
            out.append(replace(r, arrival_s=0.0))
            continue
        out.append(replace(r, arrival_s=t))
        t += rng.expovariate(rate)
    return out


def make_trace(name: str, seed: int = 0, rate: float | None = None, **params: object) -> Trace:
    """Build trace ``name`` from its generator with ``params``; seeded, deterministic."""
    if name not in GENERATORS:
        raise WorkloadError(f"unknown workload {name!r}; known: {sorted(GENERATORS)}")
    rng = random.Random(seed)
    try:
        requests = GENERATORS[name](rng, **params)
    except TypeError as exc:
        raise WorkloadError(f"workload {name!r}: {exc}") from exc
    requests = stamp_arrivals(requests, rng, rate)
    return Trace(name=name, requests=tuple(requests), params={"seed": seed, "rate": rate, **params})
