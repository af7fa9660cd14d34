"""The draft_model proposer: exact greedy outputs, KV rollback after rejections, block shortage,
and the refusal of a draft with another vocabulary."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest

from carpool.config import SpeculativeConfig
from carpool.core.block_manager import BlockManager
from carpool.engine import LLMEngine
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from carpool.spec.draft_model import DraftModelProposer
from tests.conftest import PROMPTS
from tests.helpers import run_greedy
from tests.model.test_hf_models import write_checkpoint

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(engine_fp32):
    return [engine_fp32.tokenizer.encode(p) for p in PROMPTS[:6]]


@pytest.fixture(scope="module")
def plain(engine_fp32, prompts):
    return run_greedy(engine_fp32, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def self_drafting(model_path):
    """The embedded model drafting for itself, both in float32."""
    engine = LLMEngine(model=model_path, dtype="float32", quantization="none", kv_cache_memory=64 << 20,
                       speculative_config={"method": "draft_model", "model": model_path,
                                           "num_speculative_tokens": 4})
    yield engine
    engine.proposer.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, engine_fp32) -> SpeculativeConfig:
    """A tiny random model with the embedded model's tokenizer: its drafts are mostly wrong."""
    folder = tmp_path_factory.mktemp("random-draft")
    write_checkpoint(folder, engine_fp32.tokenizer)
    return SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=4)


def target(request_id: str, token_ids: list[int]) -> Request:
    request = Request(request_id, token_ids, SamplingParams(temperature=0.0))
    request.status = RequestStatus.RUNNING
    return request


@pytest.mark.slow  # a second copy of the embedded model as the draft: ~12 s
def test_self_drafting_keeps_greedy_outputs(self_drafting, prompts, plain):
    assert run_greedy(self_drafting, prompts, MAX_TOKENS) == plain
    stats = self_drafting.spec_stats
    assert stats.num_accepted_tokens > 0
    # A draft identical to the target loses a token only to rounding between batch shapes.
    assert stats.acceptance_rate > 0.9
    assert not self_drafting.block_manager.holders()
    self_drafting.proposer.propose([], [])  # reaps the finished requests' shadows
    assert not self_drafting.proposer.shadows
    assert not self_drafting.proposer.block_manager.holders()


def test_rolled_back_shadows_draft_as_fresh_ones(self_drafting, random_draft):
    """After rejections (the target keeps some drafts, then differs), a shadow's proposals equal
    those of a proposer that computes every token from scratch: the KV it kept is valid."""
    rng = random.Random(0)
    vocab = self_drafting.model_config.vocab_size
    incremental = DraftModelProposer(random_draft, self_drafting)
    fresh = DraftModelProposer(random_draft, self_drafting)
    targets = [target(str(i), [rng.randrange(vocab) for _ in range(n)]) for i, n in enumerate((40, 7, 23))]
    num_rejections = 0
    for _ in range(8):
        limits = [rng.randint(0, 4) for _ in targets]
        got = incremental.propose(targets, limits)
        fresh.close()
        assert got == fresh.propose(targets, limits)
        for request, drafts, limit in zip(targets, got, limits):
            assert len(drafts) == limit
            keep = rng.randint(0, len(drafts))
            nxt = (drafts[keep] + 1) % vocab if keep < len(drafts) else rng.randrange(vocab)
            request.token_ids += drafts[:keep] + [nxt] + [rng.randrange(vocab) for _ in range(rng.randint(0, 2))]
            num_rejections += keep < len(drafts)
    assert num_rejections > 5
    targets[1].status = RequestStatus.FINISHED_STOPPED
    assert incremental.propose(targets[:1], [2]) == fresh.propose(targets[:1], [2])
    assert len(incremental.shadows) == 2  # the finished request's shadow is gone
    incremental.close()
    fresh.close()
    assert not incremental.block_manager.holders() and not fresh.block_manager.holders()


def test_long_prompt_catches_up_over_several_calls(self_drafting, random_draft):
    """With 16 tokens per draft forward, a 40-token prompt drafts nothing for two calls (its
    catch-up goes on), then what a proposer that took it in one piece drafts; a request already
    level drafts all along."""
    chunked = DraftModelProposer(random_draft, self_drafting)
    chunked.max_step_tokens = 16
    whole = DraftModelProposer(random_draft, self_drafting)
    long, short = target("long", list(range(100, 140))), target("short", list(range(200, 205)))
    expected = whole.propose([long, short], [3, 3])
    assert [len(d) for d in expected] == [3, 3]
    got = [chunked.propose([long, short], [3, 3]) for _ in range(3)]
    assert [d[0] for d in got] == [[], [], expected[0]]
    assert all(d[1] == expected[1] for d in got)
    assert chunked.shadows[long].num_computed_tokens == 42  # 40 tokens and 2 of its 3 drafts
    chunked.close()
    whole.close()


def test_requests_that_do_not_fit_get_no_drafts(self_drafting, random_draft):
    proposer = DraftModelProposer(random_draft, self_drafting)
    proposer.block_manager = BlockManager(4, self_drafting.config.block_size)  # 64 tokens
    first, second = target("a", list(range(1, 41))), target("b", list(range(1, 31)))
    drafts = proposer.propose([first, second], [4, 4])  # 43 slots (3 blocks), then 33 (3 blocks)
    assert len(drafts[0]) == 4 and drafts[1] == []
    first.status = RequestStatus.FINISHED_ABORTED  # its shadow goes first
    assert len(proposer.propose([second], [4])[0]) == 4
    assert set().union(*proposer.block_manager.holders().values()) == {proposer.shadows[second].request_id}
    proposer.close()
    assert not proposer.block_manager.holders()


def test_draft_with_another_vocabulary_is_refused(tmp_path, engine_fp32):
    tokenizer = engine_fp32.tokenizer
    write_checkpoint(tmp_path / "target", tokenizer)
    write_checkpoint(tmp_path / "draft", tokenizer, vocab_size=1000)
    threads = threading.active_count()
    with pytest.raises(ValueError, match=r"draft model .*draft has a vocabulary of 1000 tokens, the target "
                                         r".*target one of 49152"):
        LLMEngine(model=str(tmp_path / "target"), dtype="float32", kv_cache_memory=16 << 20,
                  speculative_config={"method": "draft_model", "model": str(tmp_path / "draft")})
    assert threading.active_count() == threads


def test_draft_with_another_tokenizer_is_refused(tmp_path, engine_fp32, model_path):
    """Same vocabulary size, two token ids swapped."""
    write_checkpoint(tmp_path, engine_fp32.tokenizer)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    message = f"draft model {tmp_path} and the target {model_path} have different tokenizers"
    with pytest.raises(ValueError, match=re.escape(message)):
        DraftModelProposer(SpeculativeConfig(method="draft_model", model=str(tmp_path)), engine_fp32)
