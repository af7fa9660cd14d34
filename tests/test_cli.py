"""The command line on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cli(*args, stdin=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "carpool.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.slow
def test_generate_streams_an_answer():
    # float32: the reference arithmetic, so the answer does not depend on the CPU's bf16 kernels
    # (with AMX bf16 this small model answers "L'Étoile, la Marseillaise, ..." instead).
    r = run_cli("generate", "What is the capital of France?", "--max-tokens", "16", "--num-threads", "1",
                "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow
def test_chat_session():
    r = run_cli("chat", "--max-tokens", "12", "--num-threads", "1", stdin="What is 2+2?\n/reset\nSay hi.\n")
    assert r.returncode == 0, r.stderr
    answers = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(answers) >= 2 and "4" in r.stdout


def test_bad_flag_values_give_clear_errors():
    r = run_cli("generate", "hi", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr
    r = run_cli("generate", "hi", "--dtype", "int3")
    assert r.returncode == 2 and "dtype" in r.stderr
    r = run_cli("generate", "hi", "--scheduler", "magic")
    assert r.returncode == 2 and "magic" in r.stderr


def test_export_tokenizer_writes_a_folder_transformers_loads(tmp_path):
    """The GGUF's tokenizer, written out, encodes and applies the chat template as carpool's own."""
    from transformers import AutoTokenizer

    from carpool.config import default_model_path
    from carpool.tokenizer import load_tokenizer

    from carpool.cli import main

    assert main(["export-tokenizer", default_model_path(), str(tmp_path / "tok")]) == 0
    exported, ours = AutoTokenizer.from_pretrained(str(tmp_path / "tok")), load_tokenizer(default_model_path())
    for text in ("Hello wörld 12345", "<|im_start|>user\nÉclair? 🍰<|im_end|>", "  spaces\tand\nlines  "):
        assert exported.encode(text) == ours.encode(text), text
        assert exported.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    chat = [{"role": "user", "content": "Hi"}]
    assert exported.apply_chat_template(chat, tokenize=False) == ours.apply_chat_template(chat, tokenize=False)
    assert exported.model_max_length == 8192  # the model's context
    assert main(["export-tokenizer", "a", "b", "c"]) == 2


def test_serve_starts_its_engine_before_the_frontend_imports_torch():
    """`carpool serve` parses its flags and builds its config without importing torch, so the
    engine process starts loading while the frontend imports the server (server/launch.py)."""
    code = ("import sys\n"
            "from carpool.args import apply_vllm_engine_flags, engine_config_from_args\n"
            "from carpool.cli import parse_args\n"
            "from carpool.server.launch import plan_cpus\n"
            "from carpool.server.options import ServerOptions\n"
            "args = parse_args(['serve', '--model', 'm.gguf', '--max-num-seqs', '8'])\n"
            "config = apply_vllm_engine_flags(args, engine_config_from_args(args))\n"
            "ServerOptions.from_args(args)\n"
            "plan_cpus(config)\n"
            "assert config.max_num_seqs == 8\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
