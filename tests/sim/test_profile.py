"""`carpool profile`: on a synthetic engine whose step cost is known, and end to end on a tiny
random Llama with `carpool fidelity`."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cli import main
from carpool.core.block_manager import BlockManager
from carpool.core.cost_profile import FittedCostModel, Profile
from carpool.core.scheduler import make_scheduler
from carpool.core.step_cost import FEATURES, BatchShape, features
from carpool.request import Request, RequestStatus
from carpool.sim.profile import agreement, profile_engine, profile_phases
from tests.helpers import examples
from tests.model.test_hf_folder import write_checkpoint

TINY = ["--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB"]


class SyntheticEngine:
    """The engine's serving interface over the real schedulers and block manager, whose steps
    take `cost(shape)` seconds times a seeded jitter of +-`jitter`, on no clock at all."""

    def __init__(self, cost, jitter: float = 0.0, seed: int = 0, max_model_len: int = 4096):
        self.cost, self.jitter, self.rng = cost, jitter, random.Random(seed)
        self.block_manager = BlockManager(num_blocks=8192, block_size=16, enable_prefix_caching=True)
        self.config = SimpleNamespace(max_num_seqs=256, model=None, num_threads=1)
        self.model_config = SimpleNamespace(vocab_size=32000)
        self.max_model_len = max_model_len
        self.scheduler = make_scheduler("sarathi", self.block_manager, 512, 256, max_model_len)
        self.iteration_stats: list[SimpleNamespace] = []
        self._observers = []
        self._ids = itertools.count()

    def add_request(self, ids, params) -> Request:
        r = Request(f"synthetic-{next(self._ids)}", ids, params)
        self.scheduler.add_request(r)
        return r

    def add_batch_observer(self, observe):
        self._observers.append(observe)
        return lambda: self._observers.remove(observe)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def step(self) -> list:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        for observe in self._observers:
            observe(batch)
        seconds = self.cost(BatchShape.of(batch)) * (1 + self.rng.uniform(-self.jitter, self.jitter))
        for r in self.scheduler.commit(batch):
            r.append_token(1, 0.0)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                self.scheduler.finish(r, RequestStatus.FINISHED_LENGTH)
        self.iteration_stats.append(SimpleNamespace(duration=seconds))
        return []


def random_shape(rng: random.Random) -> BatchShape:
    """A batch like serving makes: up to 32 decodes, up to two chunks (no drafts: the profile
    runs no speculation)."""
    decodes = tuple(rng.randrange(16, 1600) for _ in range(rng.randrange(0, 33)))
    chunks = tuple((rng.randrange(1, 1024), rng.randrange(0, 1000)) for _ in range(rng.randrange(0 if decodes else 1, 3)))
    return BatchShape(chunks, decodes, len(decodes) + len(chunks))


# Positive weights on every feature the profile can see (drafts aside), each spanning two orders
# of magnitude around what a CPU step shows.
weights = st.tuples(*[st.floats(0.1, 10.0) for name in FEATURES if name != "drafts"])


@settings(max_examples=examples(16), deadline=None)
@given(scale=weights, seed=st.integers(0, 1000))
def test_profile_plus_fit_recover_a_known_cost_within_2_percent(scale, seed):
    """A step cost in the fit's features, measured with +-1% jitter: the profile's designed
    workloads reach every feature, so their fit predicts unseen batches within 2%."""
    base = dict(zip(FEATURES, [4e-3, 0.5, 0.2, 0.1, 0.05, 0.3, 0.5, 0.2, 0.01, 2e-3, 0.4, 8e-3, 0.0, 0.1, 0.2]))
    factors = iter(scale)
    w = [0.0 if name == "drafts" else base[name] * next(factors) for name in FEATURES]
    cost = lambda shape: sum(a * x for a, x in zip(w, features(shape)))  # noqa: E731
    engine = SyntheticEngine(cost, jitter=0.01, seed=seed)
    model = FittedCostModel.from_profile(profile_engine(engine, repeats=1))
    rng = random.Random(seed)
    for shape in (random_shape(rng) for _ in range(200)):
        assert model.stage_time(shape, 0) == pytest.approx(cost(shape), rel=0.02), shape
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 8192


def test_agreement_separates_host_speed_from_shape():
    """Two profiles of one cost, the second on a host 10% slower and with one kind of step
    slower still: the speed factor comes out, and only that kind disagrees after it."""
    cost = lambda shape: 0.005 + 1e-3 * shape.num_tokens  # noqa: E731
    a = profile_engine(SyntheticEngine(cost), repeats=1)
    slower = lambda shape: 1.1 * cost(shape) * (1.05 if shape.prefills else 1.0)  # noqa: E731
    b = profile_engine(SyntheticEngine(slower), repeats=1)
    gap = agreement(b, a)
    assert 1.1 * 0.99 <= gap["speed"] <= 1.1 * 1.05 * 1.01
    assert gap["raw"]["median"] >= 0.09  # every shape moved by the host's speed
    assert 0.01 < gap["shape"]["max"] < 0.07  # after it, about the 5% of one kind of step
    assert agreement(a, a)["raw"]["max"] == pytest.approx(0.0, abs=1e-9)


def test_phases_fit_the_model_length():
    for max_len in (512, 8192):
        for phase in profile_phases(max_len, 1000):
            assert len(phase.warm) < max_len, phase.name
            assert all(len(p) + n <= max_len for p, n in zip(phase.prompts, phase.max_tokens)), phase.name


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, engine_fp32) -> str:
    folder = tmp_path_factory.mktemp("tiny_profiled")
    write_checkpoint(folder, "llama", engine_fp32.tokenizer)  # max_position_embeddings 512
    return str(folder)


@pytest.mark.slow
def test_profile_then_fidelity(tiny_model, tmp_path):
    profile = tmp_path / "profile.json"
    assert main(["profile", "--model", tiny_model, *TINY, "--quick", "--repeats", "1",
                 "--output", str(profile)]) == 0
    steps = Profile.load(profile).steps
    assert len(steps) > 50 and all(math.isfinite(t) and t > 0 for _, t in steps)
    assert any(s.prefills and not s.decode_contexts for s, _ in steps)  # prefill alone
    assert any(len(s.decode_contexts) >= 16 and not s.prefills for s, _ in steps)  # wide decode-only
    model = FittedCostModel.load(profile)
    small = model.stage_time(BatchShape(decode_contexts=(100,), num_sampled=1), 0)
    big = model.stage_time(BatchShape(prefills=((256, 0),), decode_contexts=(100,) * 8, num_sampled=9), 0)
    assert 0 < small < big

    out = tmp_path / "fidelity"
    assert main(["fidelity", "--profile", str(profile), "--model", tiny_model, *TINY,
                 "--schedulers", "sarathi,vllm,sarathi:dynamic", "--num-requests", "8", "--prompt-range", "16,200",
                 "--output-range", "4,12", "--qps", "4", "--real-runs", "2", "--output", str(out)]) == 0
    results = json.loads((out / "fidelity.json").read_text())["results"]
    assert [r["scheduler"] for r in results] == ["sarathi", "vllm", "sarathi:dynamic"]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    for r in results:
        assert r["iterations"] > 0 and r["simulated_iterations"] > 0
        assert set(r["latency"]) == {"ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99"}
        assert all(v["real"] > 0 and v["simulated"] > 0 for v in r["latency"].values())
        # steps run one after another inside the span from the first arrival to the last token
        for column in (r, r["online"], r["profile_at_speed"]):
            assert all(0 < column["busy"][k] <= 1.01 for k in ("real", "simulated"))
        # every scheduler's columns, recomputed from its own steps by one formula
        mine = [s for s in steps if s["scheduler"] == r["scheduler"]]
        assert len(mine) == r["iterations"] and all(s["measured_s"] > 0 and s["idle_before_s"] >= 0 for s in mine)
        for column, key in ((r, "profile_s"), (r["online"], "online_s"),
                            (r["profile_at_speed"], "profile_at_speed_s")):
            signed = [s[key] / s["measured_s"] - 1 for s in mine]
            assert column["iteration_error_p50"] == pytest.approx(statistics.median(map(abs, signed)))
            decodes = [e for e, s in zip(signed, mine) if not s["prefills"]]
            if decodes:
                assert column["decode_iteration_bias"] == pytest.approx(statistics.median(decodes))
        requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
        mine = [q for q in requests if q["scheduler"] == r["scheduler"]]
        columns = ("real", "profile", "online", "profile_at_speed", "real_run_2")
        assert len(mine) == 8 and all(q[k]["ttft_s"] > 0 for q in mine for k in columns)
        # the P99 of eight TTFTs is nearly the largest: the percentile comes from these records
        assert r["latency"]["ttft_p99"]["real"] <= max(q["real"]["ttft_s"] for q in mine) + 1e-9
        # the second real run is compared with the first as a simulation is
        (again,) = r["real_again"]
        assert again["iterations"] > 0 and 0 < again["busy"]["simulated"] <= 1.01
        p99 = again["latency"]["ttft_p99"]
        assert p99["real"] == r["latency"]["ttft_p99"]["real"]
        assert p99["simulated"] <= max(q["real_run_2"]["ttft_s"] for q in mine) + 1e-9
        assert p99["error"] == pytest.approx(p99["simulated"] / p99["real"] - 1)
    table = (out / "fidelity.md").read_text()
    assert "| sarathi, profile |" in table and "| sarathi, profile at the host's speed |" in table
    assert "| sarathi:dynamic, the engine again (run 2) |" in table
