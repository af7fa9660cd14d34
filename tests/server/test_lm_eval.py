"""lm-evaluation-harness end to end: its `local-completions` model scores a small multiple-choice
task (loglikelihoods: echo + logprobs over prompt token ids) against a real `carpool serve`, with
the tokenizer `carpool export-tokenizer` wrote. The task's data is local (no hub access)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest

from tests.server.serve_process import start_serve

DOCS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"]),
    ("Two plus two equals", [" four", " seven", " nine"]),
    ("The color of the sky on a clear day is", [" blue", " green", " purple"]),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Rankine"]),
]
TASK = """task: carpool_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_lm_eval_local_completions_scores_a_task(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"question": q, "choices": c, "answer": 0}) + "\n" for q, c in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    r = subprocess.run([sys.executable, "-m", "carpool.cli", "export-tokenizer", str(tmp_path / "tok")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p, url = start_serve("--served-model-name", "smol", "--dtype", "float32", "--num-threads", "1",
                         "--kv-cache-memory", "64MiB", "--enforce-eager", "--uvicorn-log-level", "warning",
                         "--disable-uvicorn-access-log")
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=smol,base_url={url}/v1/completions,tokenizer={tmp_path / 'tok'},"
                       "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1",
            tasks=["carpool_tiny"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
            limit=len(DOCS), log_samples=True)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    result = out["results"]["carpool_tiny"]
    samples = out["samples"]["carpool_tiny"]
    assert len(samples) == len(DOCS)
    for sample in samples:  # one (loglikelihood, is_greedy) per choice, from the server's logprobs
        scores = [resp[0][0] for resp in sample["resps"]]
        assert len(scores) == 3 and all(math.isfinite(s) and s < 0 for s in scores)
    # easy questions: the 135M model prefers the right continuation on at least 3 of the 4
    assert result["acc,none"] >= 0.75
