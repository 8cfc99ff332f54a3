"""EleutherAI's lm-eval as a client of a real `minivllm serve` process: its
``local-completions`` model (how vLLM servers are scored) gives the same scores as its
``hf`` model on the same float32 checkpoint, on the bundled tasks (evals/tasks/): the
same multiple-choice accuracy, the same generated texts and exact-match score, and each
choice's log-likelihood equal to float noise. A few items per task keep it short; `make
eval` runs them all (evals/run.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e '.[eval]'")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] ('.[eval]')")

from evals.run import (  # noqa: E402
    generations,
    hf_model_args,
    loglikelihoods,
    run_lm_eval,
    scores,
    serve,
    server_model_args,
)

pytestmark = pytest.mark.slow  # the real model, a server process and transformers: ~40 s

LIMIT = 6  # items per task
NUM_CHOICES = 4


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_local_completions_scores_equal_the_hf_backend_s(smollm2_path, one_thread):
    with serve(smollm2_path, threads=1) as process:
        hf = run_lm_eval("hf", hf_model_args(smollm2_path), LIMIT)  # while the server loads
        process.wait_ready()
        model_args = server_model_args(process.url, smollm2_path, num_concurrent=4)
        server = run_lm_eval("local-completions", model_args, LIMIT)

    assert set(scores(server)) == {
        ("minivllm_facts", "acc,none"),
        ("minivllm_facts", "acc_norm,none"),
        ("minivllm_capitals", "exact_match,strip"),
    }
    assert scores(server) == scores(hf)
    texts = generations(server)
    assert len(texts) == LIMIT and all(resp[0][0].strip() for resp in texts.values())
    assert texts == generations(hf)
    served, reference = loglikelihoods(server), loglikelihoods(hf)
    assert len(served) == LIMIT * NUM_CHOICES
    assert served == {key: pytest.approx(value, abs=1e-3) for key, value in reference.items()}
